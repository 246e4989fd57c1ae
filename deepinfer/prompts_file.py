"""`--prompts-file` lines: read as bytes so that each bad line (not UTF-8, not JSON, not an object, a lone
surrogate, an unknown key) becomes that line's error instead of the run's; plain lines split into the prompt
object and its sampling overrides."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path
from typing import Any

from deepinfer.errors import ConfigError, RequestError
from deepinfer.runtime.sampling import SamplingParams
from deepinfer.serving.recipe import check_text

_ITEM_KEYS = ("prompt", "messages", "token_ids", "thinking", "so_args", "max_reasoning_tokens")
_OVERRIDES = tuple(f.name for f in fields(SamplingParams))  # a line may set any sampling parameter


def read_lines(path: Path):
    """(line number, JSON object or None, error or None) for each non-blank line of a prompts file."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"--prompts-file {str(path)!r} cannot be read: {exc.strerror or exc}") from None
    for lineno, raw in enumerate(data.split(b"\n"), 1):
        if not raw.strip():
            continue
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            yield lineno, None, f"not valid UTF-8 (byte 0x{raw[exc.start]:02x} at column {exc.start + 1})"
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            yield lineno, None, f"not valid JSON: {exc}"
            continue
        if not isinstance(obj, dict):
            yield lineno, None, f"each line must be a JSON object, got {type(obj).__name__}"
            continue
        try:
            check_text(obj)
        except RequestError as exc:
            yield lineno, None, str(exc)
            continue
        yield lineno, obj, None


def plain_line(obj: dict[str, Any], thinking: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """A plain prompts-file line -> (prompt object, sampling overrides); RequestError names an unknown key."""
    overrides = {k: obj[k] for k in _OVERRIDES if obj.get(k) is not None}
    item = {k: v for k, v in obj.items() if k in _ITEM_KEYS}
    unknown = sorted(set(obj) - set(item) - set(_OVERRIDES))
    if unknown:
        raise RequestError(f"unknown key(s) {unknown}; accepted: {', '.join(_ITEM_KEYS)}, {', '.join(_OVERRIDES)}, "
                           "or an API request line with 'body'")
    if "seq_seed" in overrides and "seed" not in overrides:  # the alias overrides --seed as `seed` would
        overrides["seed"] = overrides.pop("seq_seed")
    if "messages" in item:
        item.setdefault("thinking", thinking)
    return item, overrides
