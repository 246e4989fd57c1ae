"""The Python API: `LLM(model=...)` and `.generate(...)` / `.chat(...)`, in the style of offline engines."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence, Union

from deepinfer.assemble import EngineOptions, assemble_v4, assemble_v41, check_v41_backend, progress_bar
from deepinfer.config_v41 import V41Config, read_config
from deepinfer.runtime.backend import select as select_backend
from deepinfer.runtime.engine import Engine, RunStats
from deepinfer.env import Env
from deepinfer.errors import RequestError
from deepinfer.runtime.scheduler import SchedulerConfig
from deepinfer.serving.structured import THINK_END, Constraint, Grammars, from_so_args
from deepinfer.serving.api_requests import APIError, APIRequest, convert
from deepinfer.serving.recipe import SERVED_MODEL_NAME, EncodedPrompt, Recipe, tokenizer_path
from deepinfer.runtime.request import Request, RequestFailure, RequestOutput
from deepinfer.runtime.sampling import SamplingParams, request_seed
from deepinfer.options import check_options, model_len, resolve_dtype

log = logging.getLogger("deepinfer")

PromptInput = Union[str, dict]


class LLM:
    """A DeepSeek-V4 or V4.1 model ready to generate (V4.1: on the CPU reference path).

    model: an HF-format model directory (V4.1: also DeepSeek's own config spelling); None means
    `DEEPINFER_HF_MODEL_DIR`, and when that is unset too, the embedded tiny model with random weights
    (`deepinfer.tiny`).
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
        quantization: str = "auto",
        async_scheduling: bool = True,
    ):
        check_options(model, backend, dtype, tokenizer, max_num_seqs, max_prefill_tokens, max_model_len, num_blocks,
                      gpu_memory_utilization, random_seed, quantization)
        env = Env.read()
        model = model if model is not None else env.hf_model_dir
        self.model_dir = Path(model) if model is not None else None
        self.random_weights = self.model_dir is None
        if self.model_dir is None:
            from deepinfer.tiny import tiny_config

            cfg = tiny_config()
        else:
            cfg = read_config(self.model_dir)
        self.config = cfg
        v41 = isinstance(cfg, V41Config)
        if v41:  # before the backend resolves: a target V4.1 does not run on is refused on any machine
            check_v41_backend(backend if backend is not None else env.accelerator)
        self.backend = select_backend(backend, env.cache_dir, env)
        torch_dtype = resolve_dtype(dtype, self.backend.target.default_dtype)
        self.max_model_len = model_len(cfg, max_model_len)
        # checked before the weights load: the tokenizer, the cache's size against memory, the checkpoint's files
        begin = time.perf_counter()
        self.recipe = Recipe(tokenizer if tokenizer is not None else tokenizer_path(self.model_dir),
                             v41=True if v41 else None)
        log.info("deepinfer: start-up: tokenizer %.2f s (%s)", time.perf_counter() - begin, self.recipe.path)
        self.keep_quantized = quantization == "auto"  # FP8 / FP4 checkpoint tensors stay quantized (V4 and V4.1)
        opts = EngineOptions(max_num_seqs, max_model_len, num_blocks, gpu_memory_utilization, random_seed,
                             quantization, show_progress)
        if v41:
            built = assemble_v41(cfg, self.model_dir, self.recipe.path, self.backend, torch_dtype, env, opts)
        else:
            built = assemble_v4(cfg, self.model_dir, self.backend, torch_dtype, env, opts)
        self.model, self.cache, self.weight_bytes = built.model, built.cache, built.weight_bytes
        self.memory_report, self.mtp_tensors = built.memory_report, built.mtp_tensors
        log.debug(self.memory_report)
        self.grammars = Grammars(self.recipe.path, cfg.vocab_size, cfg.eos_token_ids, self.recipe.is_v41,
                                 self.recipe.special_token_id(THINK_END))
        self.served_names = (SERVED_MODEL_NAME,) + ((self.model_dir.name,) if self.model_dir is not None else ())
        self.engine = Engine(built.steps, self.cache, SchedulerConfig(max_num_seqs, max_prefill_tokens, async_scheduling),
                             self.grammars, max_len=self.max_model_len)
        begin = time.perf_counter()
        self.engine.capture_all()  # every decode-graph bucket at start, not in the first requests' path
        log.info("deepinfer: start-up: graph capture %.2f s (every decode bucket)", time.perf_counter() - begin)
        self.last_stats: RunStats | None = None

    # ---- public API ----------------------------------------------------------------------------
    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | dict | Sequence[SamplingParams | dict] | None = None,
        *,
        use_tqdm: bool = True,
        on_output: Callable[[RequestOutput | RequestFailure], None] | None = None,
        errors: str = "raise",
    ) -> list[RequestOutput | RequestFailure]:
        """Generate for raw-text prompts (str or {"prompt": ...}), chats ({"messages": [...]}) or token ids
        ({"token_ids": [...]}). A dict may also set "thinking" (chat only), "so_args" (structured output: one
        of json_schema, regex, ebnf) and "max_reasoning_tokens" (a thinking budget, thinking only).

        Results come back in input order; `on_output(result)` is also called with each one as soon as it is
        final (in completion order). `errors="raise"` raises RequestError for the first invalid prompt before
        anything runs; `errors="return"` gives a RequestFailure in that prompt's place and runs the others."""
        items = _prompt_list(prompts)
        return self._generate(items, _expand_params(sampling_params, len(items)), use_tqdm, on_output, errors)

    def chat(
        self,
        messages: Sequence[dict] | Sequence[Sequence[dict]] | dict,
        sampling_params: SamplingParams | dict | Sequence[SamplingParams | dict] | None = None,
        *,
        thinking: bool = False,
        so_args: dict | None = None,
        api: str = "chat.completions",
        use_tqdm: bool = True,
        on_output: Callable[[RequestOutput | RequestFailure], None] | None = None,
        errors: str = "raise",
    ) -> list[RequestOutput | RequestFailure] | list[RequestOutput | APIError]:
        """Replies to one conversation (a list of message dicts) or to several (a list of those); or, given a
        whole request body (a dict with "model"), the API's response to it (`api`: chat.completions,
        responses or messages)."""
        if isinstance(messages, dict):
            return self.serve([{"api": api, "body": messages}], use_tqdm=use_tqdm, on_output=on_output)
        items = [{"messages": c, "thinking": thinking, **({"so_args": so_args} if so_args is not None else {})}
                 for c in _conversations(messages)]
        return self._generate(items, _expand_params(sampling_params, len(items)), use_tqdm, on_output, errors)

    def serve(self, lines: Sequence[dict], *, stream: bool = False, use_tqdm: bool = True,
              on_chunk: Callable[[str, dict], None] | None = None,
              on_output: Callable[[RequestOutput | APIError], None] | None = None) -> list[RequestOutput | APIError]:
        """Requests in the APIs' own shapes (OpenAI batch lines: {"custom_id", "url" or "api", "body"}). Each
        result is a RequestOutput whose `response` is the API's response object (with `stream`, `chunks` is its
        stream, each chunk also passed to `on_chunk(custom_id, chunk)` as soon as it is produced), or an
        APIError with the API's error body; an invalid request does not stop the others. `on_output` is
        called with each result as soon as it is final (errors first, then in completion order)."""
        if isinstance(lines, (str, bytes, dict)) or not isinstance(lines, Sequence):
            raise RequestError(f"serve() takes a list of request lines, got {type(lines).__name__}")
        results: list[RequestOutput | APIError | None] = []
        entries: list[_Entry] = []
        for i, line in enumerate(lines):
            converted = convert(self.recipe, line, i, self.engine.max_len, stream, self.served_names,
                                self._validate, on_chunk)
            if isinstance(converted, APIRequest):
                prep = Prepared(converted.prompt, None, converted.constraint, converted.thinking,
                                converted.reasoning_budget)
                entries.append(_Entry(i, prep, converted.params, converted.output, converted.custom_id))
            elif on_output is not None:
                on_output(converted)
            results.append(converted if isinstance(converted, APIError) else None)
        for out in self._run(entries, use_tqdm, on_output):
            results[out.index] = out
        return results

    # ---- internals -----------------------------------------------------------------------------
    def _generate(self, items: list, params: list[SamplingParams], use_tqdm: bool, on_output, errors: str):
        if errors not in ("raise", "return"):
            raise RequestError(f"errors={errors!r} is invalid; accepted: 'raise', 'return'")
        results: list[RequestOutput | RequestFailure | None] = [None] * len(items)
        entries: list[_Entry] = []
        for i, (item, p) in enumerate(zip(items, params)):
            try:
                prep = self._prepare(item)
                self._validate(prep.prompt.token_ids, p.max_new_tokens, prep.constraint, p, prep.thinking,
                               prep.reasoning_budget)
            except RequestError as exc:
                if errors == "raise":
                    raise type(exc)(f"request {i}: {exc}") from exc
                results[i] = RequestFailure(i, str(exc), type(exc).__name__)
                if on_output is not None:
                    on_output(results[i])
                continue
            entries.append(_Entry(i, prep, p, self.recipe.output(prep.prompt, p.stop, f"req-{i}"), None))
        for out in self._run(entries, use_tqdm, on_output):
            results[out.index] = out
        return results

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
        unknown = sorted(set(item) - set(kinds) - {"thinking", "so_args", "max_reasoning_tokens"})
        if unknown:
            raise RequestError(f"unknown prompt key(s) {unknown}; accepted: one of prompt, messages, token_ids, and "
                               "thinking, so_args, max_reasoning_tokens")
        kind, thinking = kinds[0], item.get("thinking", False)
        if not isinstance(thinking, bool):
            raise RequestError(f"'thinking' must be true or false, got {thinking!r}")
        budget = item.get("max_reasoning_tokens")
        if budget is not None:
            if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
                raise RequestError(f"'max_reasoning_tokens' must be an integer >= 0, got {budget!r}")
            if not thinking:
                raise RequestError(f"'max_reasoning_tokens' ({budget}) needs thinking on (\"thinking\": true)")
        if thinking and kind != "messages":
            raise RequestError("'thinking' applies to chat prompts ('messages') only")
        constraint = from_so_args(item["so_args"]) if item.get("so_args") is not None else None
        if kind == "prompt":
            if not isinstance(item["prompt"], str):
                raise RequestError(f"'prompt' must be a string, got {type(item['prompt']).__name__}")
            return Prepared(self.recipe.encode_raw(item["prompt"]), item["prompt"], constraint)
        if kind == "messages":
            messages = item["messages"]
            if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
                raise RequestError(f"'messages' must be a non-empty list of message objects, got {_short(messages)}")
            return Prepared(self.recipe.encode_chat(messages, thinking=thinking), None, constraint, thinking, budget)
        ids = item[kind]
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise RequestError(f"'{kind}' must be a list of integers, got {_short(ids)}")
        return Prepared(EncodedPrompt(list(ids), None), None, constraint)

    def _validate(self, ids: list[int], max_new_tokens: int, constraint: Constraint | None,
                  params: SamplingParams | None = None, thinking: bool = False, budget: int | None = None) -> None:
        """RequestError for a request this model or cache cannot take: its prompt (length, token ids), its
        budget, its sampling parameters (logit_bias ids) and its constraint (compiled now)."""
        cfg, limit = self.config, self.engine.max_len
        if not ids:
            raise RequestError("the prompt is empty")
        if len(ids) >= limit:
            raise RequestError(
                f"the prompt has {len(ids)} tokens; the limit is {limit} positions, prompt and output together "
                f"(max_model_len {self.max_model_len}, the model's max_position_embeddings "
                f"{cfg.max_position_embeddings})"
            )
        image = getattr(cfg, "image_token_id", None)  # V4.1's image placeholder
        if image is not None and image in ids:
            raise RequestError(f"the prompt holds the image token {image}: images are not supported yet (the vision "
                               "encoder does not run); send text only")
        bad = [t for t in ids if not 0 <= t < cfg.vocab_size]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the model's vocabulary [0, {cfg.vocab_size})")
        if params is not None:
            outside = [t for t in params.logit_bias if t >= cfg.vocab_size]
            if outside:
                raise RequestError(f"logit_bias token id {outside[0]} is outside the model's vocabulary "
                                   f"[0, {cfg.vocab_size})")
        self.cache.check_fits(min(len(ids) + max_new_tokens, limit), "the request")
        if constraint is not None:
            self.grammars.compile(constraint)  # a bad schema or grammar fails before any decoding

    def _run(self, entries: list[_Entry], use_tqdm: bool, on_output=None) -> list[RequestOutput]:
        if not entries:
            return []
        now = time.perf_counter()
        requests = []
        for e in entries:
            state = self.grammars.start(e.prepared.constraint, e.prepared.thinking, e.prepared.reasoning_budget)
            requests.append(Request(index=e.index, prompt=e.prepared.prompt, params=e.params, seed=request_seed(e.params),
                                    output=e.output, prompt_text=e.prepared.text, constraint=state,
                                    custom_id=e.custom_id, arrival=now))
        bar = progress_bar(use_tqdm and len(requests) > 1, "requests", total=len(requests))

        def finished(out: RequestOutput) -> None:
            if bar is not None:
                bar.update(1)
            if on_output is not None:
                on_output(out)

        try:
            results, stats = self.engine.run(requests, on_finish=finished)
        finally:
            if bar is not None:
                bar.close()
        self.last_stats = stats
        return results


@dataclass(frozen=True)
class _Entry:
    index: int
    prepared: Prepared
    params: SamplingParams
    output: Any
    custom_id: str | None


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
    if isinstance(sampling_params, (SamplingParams, dict)):
        return [_params(sampling_params)] * n
    if isinstance(sampling_params, (str, bytes)) or not isinstance(sampling_params, Sequence):
        raise RequestError(f"sampling_params must be a SamplingParams, a dict of its fields, or a list of those; "
                           f"got {type(sampling_params).__name__}")
    params = [_params(p) for p in sampling_params]
    if len(params) != n:
        raise RequestError(f"got {len(params)} sampling parameter sets for {n} prompts; pass one, or one per prompt")
    return params


def _params(p: Any) -> SamplingParams:
    return p if isinstance(p, SamplingParams) else SamplingParams.from_dict(p)


def _prompt_list(prompts: Any) -> list:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, Sequence) and not isinstance(prompts, bytes):
        return list(prompts)
    raise RequestError(f"prompts must be a string, a prompt object, or a list of those; got {_short(prompts)}")


def _conversations(messages: Any) -> list[list[dict]]:
    """One conversation (a list of message dicts) or several (a list of such lists)."""
    if isinstance(messages, Sequence) and not isinstance(messages, (str, bytes)) and messages:
        if all(isinstance(m, dict) for m in messages):
            return [list(messages)]
        if all(isinstance(c, Sequence) and not isinstance(c, (str, bytes)) and c and
               all(isinstance(m, dict) for m in c) for c in messages):
            return [list(c) for c in messages]
    raise RequestError(f"chat() takes a conversation (a non-empty list of message objects such as "
                       f"{{'role': 'user', 'content': 'Hi'}}), a list of conversations, or a whole API request body; "
                       f"got {_short(messages)}")


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
