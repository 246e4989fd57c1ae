"""The Python API: `LLM(model=...)` and `.generate(...)` / `.chat(...)`, in the style of offline engines."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence, Union

import torch

from deepinfer.runtime.backend import select as select_backend
from deepinfer.runtime.cache import CacheLayout, CacheSpec, PagedCache
from deepinfer.config import ModelConfig
from deepinfer.runtime.engine import Engine, RunStats
from deepinfer.env import Env
from deepinfer.errors import ConfigError, RequestError
from deepinfer.model.model import DeepseekV4
from deepinfer.model.weights import ModelWeights, tensor_specs
from deepinfer.runtime.graph import DecodeGraphs
from deepinfer.compile.prebuild import prebuild
from deepinfer.runtime.scheduler import SchedulerConfig
from deepinfer.serving.structured import THINK_END, Constraint, Grammars, from_so_args
from deepinfer.serving.api_requests import APIError, APIRequest, convert
from deepinfer.serving.recipe import SERVED_MODEL_NAME, EncodedPrompt, Recipe, tokenizer_path
from deepinfer.runtime.request import Request, RequestOutput
from deepinfer.runtime.sampling import SamplingParams, request_seed

log = logging.getLogger("deepinfer")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PromptInput = Union[str, dict]


def resolve_dtype(name: str, default: str = "float32") -> torch.dtype:
    """'auto' is the target's default dtype (float32 on the CPU paths, bfloat16 on accelerators); otherwise one
    of DTYPES."""
    if name == "auto":
        return DTYPES[default]
    if name not in DTYPES:
        raise ConfigError(f"dtype {name!r} is not supported; accepted: auto, {', '.join(DTYPES)}")
    return DTYPES[name]


DEFAULT_MAX_MODEL_LEN = 8192


def cache_spec(cfg: ModelConfig, memory: tuple[int, int] | None, dtype: torch.dtype, max_seqs: int, max_model_len: int | None,
               num_blocks: int | None, gpu_memory_utilization: float, block_tokens: int = 128) -> CacheSpec:
    """Cache geometry: the block table spans max_model_len (default min(model limit, 8192)); blocks come from
    `num_blocks`, else from free device memory when the target can measure it (`memory`: free, total), else enough for every slot at full length."""
    limit = min(cfg.max_position_embeddings, max_model_len or DEFAULT_MAX_MODEL_LEN)
    if max_model_len is not None and max_model_len > cfg.max_position_embeddings:
        raise ConfigError(f"max_model_len={max_model_len} exceeds the model's max_position_embeddings "
                          f"({cfg.max_position_embeddings})")
    per_seq = -(-limit // block_tokens)
    if num_blocks is None:
        num_blocks = max_seqs * per_seq
        if memory is not None:
            unit = CacheLayout.build(cfg, CacheSpec(0, max_seqs, per_seq, block_tokens), dtype)
            per_block, per_slot = unit.block_bytes, unit.slot_bytes
            free, _ = memory
            budget = int(free * gpu_memory_utilization) - (max_seqs + 1) * per_slot - (2 << 30)  # 2 GiB activations
            if budget < 2 * per_block:  # one block and the scratch block
                raise ConfigError(f"not enough free GPU memory for the cache: {free / 2**30:.1f} GiB free, "
                                  f"gpu_memory_utilization={gpu_memory_utilization}, {max_seqs} slots of "
                                  f"{per_slot / 2**20:.0f} MiB, 2 GiB for activations; lower --max-num-seqs or set "
                                  f"--num-blocks")
            num_blocks = min(num_blocks, budget // per_block - 1)  # the cache adds a scratch block
    if num_blocks < 1:
        raise ConfigError(f"num_blocks must be >= 1, got {num_blocks}")
    return CacheSpec(num_blocks=num_blocks, max_seqs=max_seqs, max_blocks_per_seq=per_seq, block_tokens=block_tokens)


class LLM:
    """A DeepSeek-V4 model ready to generate.

    model: an HF-format model directory; None means `DEEPINFER_HF_MODEL_DIR`, and when that is unset too,
    the embedded tiny model with random weights (`deepinfer.tiny`).
    """

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        backend: str | None = None,
        dtype: str = "auto",
        tokenizer: str | Path | None = None,
        max_num_seqs: int = 64,
        max_prefill_tokens: int = 2048,
        max_model_len: int | None = None,
        num_blocks: int | None = None,
        gpu_memory_utilization: float = 0.9,
        random_seed: int = 0,
        show_progress: bool = False,
    ):
        env = Env.read()
        model = model if model is not None else env.hf_model_dir
        self.model_dir = Path(model) if model is not None else None
        self.random_weights = self.model_dir is None
        self.backend = select_backend(backend, env.cache_dir, env)
        torch_dtype = resolve_dtype(dtype, self.backend.target.default_dtype)
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
        if self.backend.kernel_target is not None:  # kernels the manifest lacks: built now, with progress
            prebuild(self.backend.kernel_target, cfg, str(torch_dtype).removeprefix("torch."), env.cache_dir,
                     show_progress)
        device = self.backend.device
        weights = ModelWeights.from_tensors(cfg, {k: v.to(device) for k, v in tensors.items()})
        self.model = DeepseekV4(cfg, weights, self.backend.ops)
        self.cache = PagedCache(cfg, cache_spec(cfg, self.backend.memory(), torch_dtype, max_num_seqs, max_model_len,
                                                num_blocks, gpu_memory_utilization), torch_dtype, device)
        self.recipe = Recipe(tokenizer if tokenizer is not None else tokenizer_path(self.model_dir))
        self.grammars = Grammars(self.recipe.path, cfg.vocab_size, cfg.eos_token_ids, self.recipe.is_v41,
                                 self.recipe.special_token_id(THINK_END))
        self.served_names = (SERVED_MODEL_NAME,) + ((self.model_dir.name,) if self.model_dir is not None else ())
        graphs = DecodeGraphs(self.model, self.cache, max_num_seqs, self.backend.capture)
        self.engine = Engine(self.model, self.cache, SchedulerConfig(max_num_seqs, max_prefill_tokens), graphs,
                             self.grammars)
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
        ({"token_ids": [...]}). A dict may also set "thinking" (chat only), "so_args" (structured output: one
        of json_schema, regex, ebnf) and "max_reasoning_tokens" (a thinking budget)."""
        items = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        prepared = [self._prepare(item) for item in items]
        return self._run(prepared, _expand_params(sampling_params, len(prepared)), use_tqdm)

    def chat(
        self,
        messages: Sequence[dict] | Sequence[Sequence[dict]] | dict,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        thinking: bool = False,
        so_args: dict | None = None,
        api: str = "chat.completions",
        use_tqdm: bool = True,
    ) -> list[RequestOutput] | list[RequestOutput | APIError]:
        """Replies to one conversation (a list of message dicts) or to several (a list of those); or, given a
        whole request body (a dict with "model"), the API's response to it (`api`: chat.completions,
        responses or messages)."""
        if isinstance(messages, dict):
            return self.serve([{"api": api, "body": messages}], use_tqdm=use_tqdm)
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        items = [{"messages": list(c), "thinking": thinking, **({"so_args": so_args} if so_args else {})}
                 for c in conversations]
        prepared = [self._prepare(item) for item in items]
        return self._run(prepared, _expand_params(sampling_params, len(prepared)), use_tqdm)

    def serve(self, lines: Sequence[dict], *, stream: bool = False, use_tqdm: bool = True,
              on_chunk: Callable[[str, dict], None] | None = None) -> list[RequestOutput | APIError]:
        """Requests in the APIs' own shapes (OpenAI batch lines: {"custom_id", "url" or "api", "body"}). Each
        result is a RequestOutput whose `response` is the API's response object (with `stream`, `chunks` is its
        stream, each chunk also passed to `on_chunk(custom_id, chunk)` as soon as it is produced), or an
        APIError with the API's error body; an invalid request does not stop the others."""
        results: list[RequestOutput | APIError | None] = []
        runnable: list[tuple[int, APIRequest, Prepared]] = []
        for i, line in enumerate(lines):
            converted = convert(self.recipe, line, i, self.engine.max_len, stream, self.served_names,
                                lambda ids, n, c, i=i: self._validate(i, ids, n, c), on_chunk)
            if isinstance(converted, APIRequest):
                runnable.append((i, converted, Prepared(converted.prompt, None, converted.constraint,
                                                        converted.thinking, converted.reasoning_budget)))
            results.append(converted if isinstance(converted, APIError) else None)
        outputs = self._run([p for _, _, p in runnable], [r.params for _, r, _ in runnable], use_tqdm,
                            [(r.output, r.custom_id) for _, r, _ in runnable]) if runnable else []
        for (i, _, _), out in zip(runnable, outputs):
            results[i] = out
        return results

    # ---- internals -----------------------------------------------------------------------------
    def _prepare(self, item: PromptInput) -> Prepared:
        if isinstance(item, str):
            return Prepared(self.recipe.encode_raw(item), item)
        if not isinstance(item, dict):
            raise RequestError(f"a prompt must be a string or an object, got {type(item).__name__}")
        kinds = [k for k in ("prompt", "messages", "token_ids", "prompt_token_ids") if k in item]
        if len(kinds) != 1:
            raise RequestError(
                f"a prompt object needs exactly one of 'prompt', 'messages' or 'token_ids'; got keys {sorted(item)}"
            )
        kind, thinking = kinds[0], bool(item.get("thinking", False))
        constraint = from_so_args(item["so_args"]) if item.get("so_args") is not None else None
        if constraint is not None:
            self.grammars.compile(constraint)
        budget = item.get("max_reasoning_tokens")
        if kind == "prompt":
            if not isinstance(item["prompt"], str):
                raise RequestError(f"'prompt' must be a string, got {type(item['prompt']).__name__}")
            return Prepared(self.recipe.encode_raw(item["prompt"]), item["prompt"], constraint)
        if kind == "messages":
            messages = item["messages"]
            if not isinstance(messages, list) or not messages:
                raise RequestError("'messages' must be a non-empty list of message objects")
            return Prepared(self.recipe.encode_chat(messages, thinking=thinking), None, constraint, thinking, budget)
        ids = item[kind]
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise RequestError(f"'{kind}' must be a list of integers")
        return Prepared(EncodedPrompt(list(ids), None), None, constraint)

    def _validate(self, index: int, ids: list[int], max_new_tokens: int, constraint: Constraint | None) -> None:
        self._check_prompt(index, ids)
        self.cache.check_fits(min(len(ids) + max_new_tokens, self.engine.max_len), f"request {index}")
        if constraint is not None:
            self.grammars.compile(constraint)  # a bad schema or grammar fails before any decoding

    def _check_prompt(self, index: int, ids: list[int]) -> None:
        cfg, limit = self.config, self.engine.max_len
        if not ids:
            raise RequestError(f"request {index}: the prompt is empty")
        if len(ids) >= limit:
            raise RequestError(
                f"request {index}: the prompt has {len(ids)} tokens; the limit is {limit} positions, prompt and "
                f"output together (the model's max_position_embeddings {cfg.max_position_embeddings}, "
                f"max_model_len {self.cache.spec.max_tokens})"
            )
        bad = [t for t in ids if not 0 <= t < cfg.vocab_size]
        if bad:
            raise RequestError(f"request {index}: token id {bad[0]} is outside the model's vocabulary [0, {cfg.vocab_size})")

    def _run(self, prepared: list[Prepared], params: list[SamplingParams], use_tqdm: bool,
             outputs: list[tuple[Any, str]] | None = None) -> list[RequestOutput]:
        now = time.perf_counter()
        requests = []
        for i, (prep, p) in enumerate(zip(prepared, params)):
            self._check_prompt(i, prep.prompt.token_ids)
            output, custom_id = outputs[i] if outputs else (self.recipe.output(prep.prompt, p.stop, f"req-{i}"), None)
            state = self.grammars.start(prep.constraint, prep.thinking, prep.reasoning_budget)
            requests.append(Request(index=i, prompt=prep.prompt, params=p, seed=request_seed(p), output=output,
                                    prompt_text=prep.text, constraint=state, custom_id=custom_id, arrival=now))
        bar = _progress_bar(use_tqdm and len(requests) > 1, "requests", total=len(requests))
        results, stats = self.engine.run(requests, on_finish=None if bar is None else (lambda _: bar.update(1)))
        if bar is not None:
            bar.close()
        self.last_stats = stats
        return results


@dataclass(frozen=True)
class Prepared:
    prompt: EncodedPrompt
    text: str | None
    constraint: Constraint | None = None
    thinking: bool = False
    reasoning_budget: int | None = None


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

