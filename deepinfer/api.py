"""The Python API: `LLM(model=...)` and `.generate(...)` / `.chat(...)`, in the style of offline engines."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Sequence, Union

import torch

from deepinfer.config import ModelConfig
from deepinfer.engine import Engine, EngineConfig, RunStats
from deepinfer.env import Env
from deepinfer.errors import ConfigError, RequestError
from deepinfer.model.model import DeepseekV4
from deepinfer.model.state import SequenceState
from deepinfer.model.weights import ModelWeights, tensor_specs
from deepinfer.recipe import EncodedPrompt, Recipe, tokenizer_path
from deepinfer.request import Request, RequestOutput
from deepinfer.sampling import SamplingParams, request_seed

log = logging.getLogger("deepinfer")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PromptInput = Union[str, dict]


def resolve_dtype(name: str) -> torch.dtype:
    """'auto' is float32 on the CPU reference path; otherwise one of DTYPES."""
    if name == "auto":
        return torch.float32
    if name not in DTYPES:
        raise ConfigError(f"dtype {name!r} is not supported; accepted: auto, {', '.join(DTYPES)}")
    return DTYPES[name]


class LLM:
    """A DeepSeek-V4 model ready to generate.

    model: an HF-format model directory; None means `DEEPINFER_HF_MODEL_DIR`, and when that is unset too,
    the embedded tiny model with random weights (`deepinfer.tiny`).
    """

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        dtype: str = "auto",
        tokenizer: str | Path | None = None,
        max_num_seqs: int = 64,
        max_prefill_tokens: int = 2048,
        random_seed: int = 0,
        show_progress: bool = False,
    ):
        model = model if model is not None else Env.read().hf_model_dir
        self.model_dir = Path(model) if model is not None else None
        self.random_weights = self.model_dir is None
        torch_dtype = resolve_dtype(dtype)
        if self.model_dir is None:
            from deepinfer.tiny import random_tensors, tiny_config

            cfg = tiny_config()
            tensors = random_tensors(cfg, seed=random_seed, dtype=torch_dtype)
            self.mtp_tensors: dict[str, Any] = {}
        else:
            from deepinfer.weights.loader import load_checkpoint

            cfg = ModelConfig.from_model_dir(self.model_dir)
            bar = _progress_bar(show_progress, "loading weights", total=len(tensor_specs(cfg)))
            ckpt = load_checkpoint(self.model_dir, cfg, torch_dtype, progress=None if bar is None else bar.update)
            if bar is not None:
                bar.close()
            tensors = ckpt.tensors
            self.mtp_tensors = ckpt.mtp
            if ckpt.mtp:
                log.info("checkpoint holds %d mtp.* tensors (MTP draft layers): recorded, not loaded", len(ckpt.mtp))
        self.config = cfg
        self.model = DeepseekV4(cfg, ModelWeights.from_tensors(cfg, tensors), _reference_ops())
        self.recipe = Recipe(tokenizer if tokenizer is not None else tokenizer_path(self.model_dir))
        self.engine = Engine(self.model, EngineConfig(max_prefill_tokens=max_prefill_tokens, max_num_seqs=max_num_seqs))
        self.last_stats: RunStats | None = None

    # ---- public API ----------------------------------------------------------------------------
    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for raw-text prompts (str or {"prompt": ...}), chats ({"messages": [...]}) or token ids
        ({"token_ids": [...]}). A dict may also set "thinking" (chat only)."""
        items = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        encoded = [self._encode(item) for item in items]
        return self._run(encoded, sampling_params, use_tqdm)

    def chat(
        self,
        messages: Sequence[dict] | Sequence[Sequence[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        thinking: bool = False,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of message dicts) or to several (a list of those)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        encoded = [self._encode({"messages": list(c), "thinking": thinking}) for c in conversations]
        return self._run(encoded, sampling_params, use_tqdm)

    # ---- internals -----------------------------------------------------------------------------
    def _encode(self, item: PromptInput) -> tuple[EncodedPrompt, str | None]:
        if isinstance(item, str):
            return self.recipe.encode_raw(item), item
        if not isinstance(item, dict):
            raise RequestError(f"a prompt must be a string or an object, got {type(item).__name__}")
        kinds = [k for k in ("prompt", "messages", "token_ids", "prompt_token_ids") if k in item]
        if len(kinds) != 1:
            raise RequestError(
                f"a prompt object needs exactly one of 'prompt', 'messages' or 'token_ids'; got keys {sorted(item)}"
            )
        kind = kinds[0]
        if kind == "prompt":
            if not isinstance(item["prompt"], str):
                raise RequestError(f"'prompt' must be a string, got {type(item['prompt']).__name__}")
            return self.recipe.encode_raw(item["prompt"]), item["prompt"]
        if kind == "messages":
            messages = item["messages"]
            if not isinstance(messages, list) or not messages:
                raise RequestError("'messages' must be a non-empty list of message objects")
            return self.recipe.encode_chat(messages, thinking=bool(item.get("thinking", False))), None
        ids = item[kind]
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise RequestError(f"'{kind}' must be a list of integers")
        return EncodedPrompt(list(ids), None), None

    def _check_prompt(self, index: int, ids: list[int]) -> None:
        cfg = self.config
        if not ids:
            raise RequestError(f"request {index}: the prompt is empty")
        if len(ids) >= cfg.max_position_embeddings:
            raise RequestError(
                f"request {index}: the prompt has {len(ids)} tokens; the model's limit (max_position_embeddings) "
                f"is {cfg.max_position_embeddings} positions, prompt and output together"
            )
        bad = [t for t in ids if not 0 <= t < cfg.vocab_size]
        if bad:
            raise RequestError(f"request {index}: token id {bad[0]} is outside the model's vocabulary [0, {cfg.vocab_size})")

    def _run(self, encoded, sampling_params, use_tqdm: bool) -> list[RequestOutput]:
        params = _expand_params(sampling_params, len(encoded))
        now = time.perf_counter()
        requests = []
        for i, ((prompt, text), p) in enumerate(zip(encoded, params)):
            self._check_prompt(i, prompt.token_ids)
            requests.append(
                Request(
                    index=i,
                    prompt=prompt,
                    params=p,
                    seed=request_seed(p),
                    output=self.recipe.output(prompt, p.stop, f"req-{i}"),
                    state=SequenceState.empty(self.config),
                    prompt_text=text,
                    arrival=now,
                )
            )
        bar = _progress_bar(use_tqdm and len(requests) > 1, "requests", total=len(requests))
        outputs, stats = self.engine.run(requests, on_finish=None if bar is None else (lambda _: bar.update(1)))
        if bar is not None:
            bar.close()
        self.last_stats = stats
        return outputs


def _reference_ops():
    from tilekernels import reference_table

    return reference_table()


def _expand_params(sampling_params, n: int) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * n
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * n
    params = list(sampling_params)
    if len(params) != n:
        raise RequestError(f"got {len(params)} sampling parameter sets for {n} prompts; pass one, or one per prompt")
    return params


def _progress_bar(enabled: bool, desc: str, total: int | None = None):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req" if desc == "requests" else "tensor", leave=False, dynamic_ncols=True)

