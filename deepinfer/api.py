"""The Python API: `LLM(model=...)` and `.generate(...)` / `.chat(...)`, in the style of offline engines."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from deepinfer.assemble import EngineOptions, assemble_v4, assemble_v41, check_v41_backend, progress_bar
from deepinfer.config_v41 import V41Config, read_config
from deepinfer.runtime.backend import select as select_backend
from deepinfer.runtime.defaults import MAX_PREFILL_TOKENS
from deepinfer.runtime.engine import Engine, RunStats
from deepinfer.runtime.speculative import speculator
from deepinfer.runtime.prefix import PrefixMode
from deepinfer.env import Env
from deepinfer.errors import ConfigError, RequestError
from deepinfer.parallel.config import ParallelConfig, eplb_config, launched_rank
from deepinfer.runtime.scheduler import SchedulerConfig
from deepinfer.serving.structured import THINK_END, Constraint, Grammars
from deepinfer.serving.api_requests import APIError, APIRequest, convert
from deepinfer.serving.recipe import SERVED_MODEL_NAME, Recipe, tokenizer_path
from deepinfer.runtime.request import Request, RequestFailure, RequestOutput
from deepinfer.runtime.sampling import SamplingParams, request_seed
from deepinfer.options import (check_options, default_draft_tokens, draft_tokens, model_len, resolve_dtype,
                               speculative_request)
from deepinfer.prompt_items import Prepared, PromptInput, conversations, expand_params, prepare, prompt_list

log = logging.getLogger("deepinfer")

class LLM:
    """A DeepSeek-V4 or V4.1 model ready to generate (V4.1: on the CPU reference path).

    model: an HF-format model directory (V4.1: also DeepSeek's own config spelling); None means
    `DEEPINFER_HF_MODEL_DIR`, and when that is unset too, the embedded tiny model with random weights
    (`deepinfer.tiny`). batch_invariant: the batch-invariant ops, so that a request's tokens do not depend on what
    it is batched with (DeepSeek-V4 only); None means `DEEPINFER_BATCH_INVARIANT` (off when unset).
    """

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        backend: str | None = None,
        dtype: str = "auto",
        tokenizer: str | Path | None = None,
        max_num_seqs: int = 64,
        max_prefill_tokens: int = MAX_PREFILL_TOKENS,
        max_model_len: int | None = None,
        num_blocks: int | None = None,
        gpu_memory_utilization: float = 0.9,
        random_seed: int = 0,
        show_progress: bool = False,
        quantization: str = "auto",
        async_scheduling: bool = True,
        batch_invariant: bool | None = None,
        prefix_cache: str | None = None,
        speculative_tokens: int | None = None,
        speculative_varlen: bool | None = None,
        data_parallel_size: int = 1,
        tensor_parallel_size: int = 1,
        enable_expert_parallel: bool = False,
        enable_eplb: bool = False,
        eplb_redundant_experts: int = 0,
        eplb_step_interval: int = 1000,
    ):
        args = {k: v for k, v in locals().items() if k in _LLM_ARGS}
        check_options(model, backend, dtype, tokenizer, max_num_seqs, max_prefill_tokens, max_model_len, num_blocks,
                      gpu_memory_utilization, random_seed, quantization, batch_invariant, prefix_cache,
                      speculative_tokens, speculative_varlen)
        self.parallel = ParallelConfig(data_parallel_size, tensor_parallel_size, enable_expert_parallel)
        eplb = eplb_config(self.parallel, enable_eplb, eplb_redundant_experts, eplb_step_interval)
        self.last_stats: RunStats | None = None
        self._pool = self._comm = None
        rank = launched_rank(self.parallel) if self.parallel.world > 1 else None
        env = Env.read()
        self.batch_invariant = args["batch_invariant"] = (env.batch_invariant if batch_invariant is None
                                                          else batch_invariant)
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
            if self.batch_invariant:
                raise ConfigError("batch invariance is implemented for DeepSeek-V4 only so far; DeepSeek-V4.1 runs "
                                  "without it: leave batch_invariant (--batch-invariant, DEEPINFER_BATCH_INVARIANT) off")
            if prefix_cache not in (None, "off"):
                raise ConfigError(f"prefix_cache={prefix_cache!r}: the prefix cache is implemented for DeepSeek-V4 "
                                  "only so far; DeepSeek-V4.1 runs without it (None or 'off')")
        if self.parallel.world > 1:
            self.parallel.check_model(cfg.num_attention_heads, cfg.o_groups, cfg.n_routed_experts,
                                      redundant=eplb.redundant_experts if eplb is not None else 0)
            if env.parallel_graphs and eplb is not None and eplb.step_interval:
                raise ConfigError(f"DEEPINFER_PARALLEL_GRAPHS=1 with EPLB rebalancing every {eplb.step_interval} "
                                  "forwards: a rebalance replaces the expert weights and tables a captured decode "
                                  "graph reads; set eplb_step_interval=0 (--eplb-step-interval 0: the placement made "
                                  "at start) or leave DEEPINFER_PARALLEL_GRAPHS off")
            if self.batch_invariant:  # the ranks' sums (NCCL picks its algorithm by message size) and EPLB's placement
                raise ConfigError("batch_invariant (--batch-invariant) runs on one device: across ranks a token's sums "
                                  "and, with EPLB, its experts' placement depend on the other traffic; leave it off or "
                                  "run data_parallel_size = tensor_parallel_size = 1")
            if rank is None:  # start one worker per rank (deepinfer's own launcher); this object drives them
                from deepinfer.parallel.pool import RankPool

                self._pool = RankPool(self.parallel, LLM, args)
                self._description = self._pool.ready[0]
                return
            from deepinfer.parallel.ranks import join

            self._comm = join(rank, backend, env)
        self.backend = select_backend(backend, env.cache_dir, env, invariant=self.batch_invariant)
        torch_dtype = resolve_dtype(dtype, self.backend.target.default_dtype)
        self.max_model_len = model_len(cfg, max_model_len)
        # checked before the weights load: the tokenizer, the cache's size against memory, the checkpoint's files
        begin = time.perf_counter()
        self.recipe = Recipe(tokenizer if tokenizer is not None else tokenizer_path(self.model_dir),
                             v41=True if v41 else None)
        log.info("deepinfer: start-up: tokenizer %.2f s (%s)", time.perf_counter() - begin, self.recipe.path)
        self.keep_quantized = quantization == "auto"  # FP8 / FP4 checkpoint tensors stay quantized (V4 and V4.1)
        # approximate hits change a request's logits a little; a batch-invariant run keeps its promise with exact
        self.prefix_cache = PrefixMode("off" if v41 else prefix_cache or ("exact" if self.batch_invariant
                                                                           else "approximate"),
                                       env.swa_replay_tokens)
        # what the cache is sized for (V4: the loaded layers decide in assemble_v4; V4.1 drafts with DSpark only)
        mtp = (cfg.dspark is not None and cfg.num_nextn_predict_layers > 0) if v41 else cfg.has_mtp
        block = cfg.dspark.block_size if mtp and cfg.dspark else 0  # DSpark: K at most its block
        drafts = speculative_request(speculative_tokens, env.nextn_decode, ranks=self.parallel.world,
                                     prefix=self.prefix_cache.mode, block=block)  # None: the default
        opts = EngineOptions(max_num_seqs, max_model_len, num_blocks, gpu_memory_utilization, random_seed,
                             quantization, show_progress, batch_invariant=self.batch_invariant,
                             prefix_cache=self.prefix_cache, max_prefill_tokens=max_prefill_tokens,
                             draft_layers=(cfg.num_nextn_predict_layers if cfg.dspark else 1) if drafts != 0 and mtp else 0,
                             lookahead=(default_draft_tokens(block) if drafts is None else drafts) if mtp else 0)
        if v41:
            built = assemble_v41(cfg, self.model_dir, self.recipe.path, self.backend, torch_dtype, env, opts,
                                 self._comm, eplb)
        else:
            built = assemble_v4(cfg, self.model_dir, self.backend, torch_dtype, env, opts, self._comm, eplb,
                                load_mtp=drafts != 0)
        self.model, self.cache, self.weight_bytes = built.model, built.cache, built.weight_bytes
        self.memory_report = built.memory_report
        log.debug(self.memory_report)
        self.grammars = Grammars(self.recipe.path, cfg.vocab_size, cfg.eos_token_ids, self.recipe.is_v41,
                                 self.recipe.special_token_id(THINK_END))
        self.served_names = (SERVED_MODEL_NAME,) + ((self.model_dir.name,) if self.model_dir is not None else ())
        self.speculative_tokens = draft_tokens(drafts, speculative_tokens is not None, self.model.weights.draft_layers,
                                               str(self.model_dir or "the tiny random model"), block)
        self.engine = Engine(built.steps, self.cache, SchedulerConfig(max_num_seqs, max_prefill_tokens, async_scheduling),
                             self.grammars, max_len=self.max_model_len, speculator=speculator(
                                 built.steps, self.speculative_tokens,
                                 env.mtp_varlen if speculative_varlen is None else speculative_varlen))
        begin = time.perf_counter()
        self.engine.capture_all()  # every decode-graph bucket at start (and its cost, for sized verification)
        log.info("deepinfer: start-up: graph capture %.2f s (every decode bucket)", time.perf_counter() - begin)

    def describe(self) -> str:
        """One line: the model, tokenizer, backend, cache and memory (and the ranks, on several)."""
        if self._pool is not None:
            return self._description
        ops = f"TileLang kernels for {self.backend.kernel_target}" if self.backend.kernel_target else "PyTorch reference ops"
        spec = self.cache.spec
        if self.batch_invariant:
            ops += ", batch-invariant"
        prefix = self.prefix_cache.mode
        if prefix == "approximate":
            prefix += f", {self.prefix_cache.replay_tokens}-token SWA replay"
        line = (f"model {self.model_dir or 'tiny-random'} ({self.config.num_hidden_layers} layers, {self.model.dtype}), "
                f"tokenizer {self.recipe.path} ({self.recipe.encoding_name} encoding), backend {self.backend.name} "
                f"({ops}), cache {spec.num_blocks} blocks x {spec.block_tokens} positions, max {self.engine.max_len} "
                f"per sequence, prefix cache {prefix}" + (f", speculative decoding {self.speculative_tokens} "
                                                          f"{'DSpark' if self.config.dspark else 'MTP'} drafts"
                                                          if self.speculative_tokens else "") + f"; {self.memory_report}")
        if self._comm is not None:
            from deepinfer.parallel.ranks import describe

            line += f"; {describe(self.parallel)}, rank 0's share"
        return line

    @property
    def leads(self) -> bool:
        """Whether this process reports the results: False on a launched rank other than 0 (under torchrun)."""
        return self._comm is None or self._comm.rank.rank == 0

    def close(self) -> None:
        """Stop the rank workers (several devices) or leave the world (a launched rank); nothing on one device."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        if self._comm is not None:
            self._comm.close()
            self._comm = None

    def _ranked(self, method: str, *args, **kwargs):
        """(result, run stats) of `method` on this rank: what the process driving the ranks receives."""
        return getattr(self, method)(*args, **kwargs), self.last_stats

    def _driven(self, method: str, *args, on_output=None, on_chunk=None, **kwargs):
        """`method` run by every rank worker (callbacks run here, once the results are in)."""
        results, self.last_stats = self._pool.call("_ranked", method, *args, **kwargs)
        for r in results:
            if on_chunk is not None:
                for chunk in getattr(r, "chunks", None) or ():
                    on_chunk(r.custom_id, chunk)
            if on_output is not None:
                on_output(r)
        return results

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
        items = prompt_list(prompts)
        return self._generate(items, expand_params(sampling_params, len(items)), use_tqdm, on_output, errors)

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
                 for c in conversations(messages)]
        return self._generate(items, expand_params(sampling_params, len(items)), use_tqdm, on_output, errors)

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
        if self._pool is not None:
            return self._driven("serve", list(lines), stream=stream, use_tqdm=use_tqdm, on_chunk=on_chunk,
                                on_output=on_output)
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
        if self._pool is not None:
            return self._driven("_generate", items, params, use_tqdm, None, errors, on_output=on_output)
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
        return prepare(self.recipe, item)

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
        comm = self._comm
        if comm is not None:  # one rank of several: its data-parallel share; every rank's results at the end
            from deepinfer.parallel.ranks import share

            entries, use_tqdm = share(entries, comm), use_tqdm and comm.rank.rank == 0
        elif not entries:
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
            drain = getattr(self.engine.steps, "drain", None)
            if drain is not None:  # this rank is done: it still answers the others' expert exchanges
                drain()
            shard = getattr(self.model, "expert_shard", None)
            if shard is not None:  # every rank (a collective)
                stats.expert_balance, stats.expert_rebalances = shard.balance(), shard.rebalances
        finally:
            if bar is not None:
                bar.close()
        if comm is not None:
            from deepinfer.parallel.ranks import gathered

            results, stats = gathered(comm, results, stats)
        self.last_stats = stats
        return results


_LLM_ARGS = ("model", "backend", "dtype", "tokenizer", "max_num_seqs", "max_prefill_tokens", "max_model_len", "num_blocks",
             "gpu_memory_utilization", "random_seed", "show_progress", "quantization", "async_scheduling",
             "batch_invariant", "prefix_cache", "speculative_tokens", "speculative_varlen",
             "data_parallel_size", "tensor_parallel_size", "enable_expert_parallel", "enable_eplb",
             "eplb_redundant_experts", "eplb_step_interval")


@dataclass(frozen=True)
class _Entry:
    index: int
    prepared: Prepared
    params: SamplingParams
    output: Any
    custom_id: str | None
