"""The one place `DEEPINFER_*` environment variables are read: typed, validated, read once into `Env`."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from deepinfer.errors import ConfigError

ACCELERATORS = ("cpu", "nvidia", "ascend")
MAX_DRAFT_TOKENS = 16  # speculative decoding: draft tokens per step at most
_FLAGS = {"0": False, "1": True, "false": False, "true": True, "off": False, "on": True}


@dataclass(frozen=True)
class Env:
    accelerator: str | None  # DEEPINFER_ACCELERATOR: cpu | nvidia | ascend (build.sh; unset = detect)
    hf_model_dir: str | None  # DEEPINFER_HF_MODEL_DIR: default --model directory
    cache_dir: Path  # DEEPINFER_CACHE_DIR: compiled kernels (default ~/.cache/deepinfer/kernels)
    dist_timeout: float = 300.0  # DEEPINFER_DIST_TIMEOUT: seconds a collective between ranks may wait
    batch_invariant: bool = False  # DEEPINFER_BATCH_INVARIANT: 1 = a request's result does not depend on its batch
    swa_replay_tokens: int = 128  # DEEPINFER_SWA_REPLAY_TOKENS: tokens an approximate prefix hit prefills again
    nextn_decode: int | None = None  # DEEPINFER_USE_NEXTN_DECODE: draft tokens per step (unset: 5 with a drafter)
    mtp_varlen: bool = False  # DEEPINFER_ENABLE_MTP_VARLEN: confidence-sized verification of the drafts
    second_stream: bool = True  # DEEPINFER_SECOND_STREAM: 0 = a decode step on one stream (no side branches)
    parallel_graphs: bool = False  # DEEPINFER_PARALLEL_GRAPHS: 1 = DeepSeek-V4's ranks decode through CUDA graphs

    @classmethod
    def read(cls, environ: Mapping[str, str] | None = None) -> Env:
        environ = os.environ if environ is None else environ
        accelerator = environ.get("DEEPINFER_ACCELERATOR") or None
        if accelerator is not None and accelerator not in ACCELERATORS:
            raise ConfigError(f"DEEPINFER_ACCELERATOR={accelerator!r} is not valid; accepted: {', '.join(ACCELERATORS)}")
        cache = environ.get("DEEPINFER_CACHE_DIR")
        cache_dir = Path(cache).expanduser() if cache else Path.home() / ".cache" / "deepinfer" / "kernels"
        timeout = environ.get("DEEPINFER_DIST_TIMEOUT") or "300"
        try:
            dist_timeout = float(timeout)
        except ValueError:
            dist_timeout = -1.0
        if not dist_timeout > 0:
            raise ConfigError(f"DEEPINFER_DIST_TIMEOUT={timeout!r} is not valid; accepted: seconds, a number > 0")
        invariant = _flag(environ, "DEEPINFER_BATCH_INVARIANT", "0", "off")
        raw_replay = environ.get("DEEPINFER_SWA_REPLAY_TOKENS") or "128"
        replay = int(raw_replay) if raw_replay.strip().isdigit() else 0
        if replay < 1:
            raise ConfigError(f"DEEPINFER_SWA_REPLAY_TOKENS={raw_replay!r} is not valid; accepted: an integer >= 1 "
                              "(tokens prefilled again before an approximate prefix hit; unset: 128)")
        raw_nextn = (environ.get("DEEPINFER_USE_NEXTN_DECODE") or "").strip()
        nextn = int(raw_nextn) if raw_nextn.isdigit() else None
        if raw_nextn and (nextn is None or nextn > MAX_DRAFT_TOKENS):
            raise ConfigError(f"DEEPINFER_USE_NEXTN_DECODE={raw_nextn!r} is not valid; accepted: an integer from 0 to "
                              f"{MAX_DRAFT_TOKENS} (draft tokens per decode step, 0 = plain decoding; unset: 5 when "
                              "the checkpoint has an MTP layer)")
        varlen = _flag(environ, "DEEPINFER_ENABLE_MTP_VARLEN", "0", "off")
        second = _flag(environ, "DEEPINFER_SECOND_STREAM", "1", "on where the target has one")
        graphs = _flag(environ, "DEEPINFER_PARALLEL_GRAPHS", "0", "off, several ranks decode eagerly")
        return cls(accelerator=accelerator, hf_model_dir=environ.get("DEEPINFER_HF_MODEL_DIR") or None,
                   cache_dir=cache_dir, dist_timeout=dist_timeout, batch_invariant=invariant,
                   swa_replay_tokens=replay, nextn_decode=nextn, mtp_varlen=varlen, second_stream=second,
                   parallel_graphs=graphs)


def _flag(environ: Mapping[str, str], name: str, default: str, unset: str) -> bool:
    """A 0/1-style switch (`_FLAGS`); `default` when unset or empty (`unset`: what that means, for the error)."""
    raw = environ.get(name) or default
    value = raw.strip().lower()
    if value not in _FLAGS:
        raise ConfigError(f"{name}={raw!r} is not valid; accepted: {', '.join(_FLAGS)} (unset or empty: {unset})")
    return _FLAGS[value]


def check_writable_dir(path: Path, what: str) -> None:
    """ConfigError unless `path` is (or can be made) a directory this process can write in; `what` names the
    option or variable it came from."""
    import tempfile

    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-check-"):
            pass
    except OSError as exc:
        raise ConfigError(f"{what} {str(path)!r} is not a writable directory: {exc.strerror or exc}") from None
