"""The generation loop: the scheduler picks each step, the model runs it through `ModelSteps` (prefill chunks,
decode batches: DeepSeek-V4 or V4.1 alike); sampled tokens are appended and finished requests release their
cache."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from deepinfer.runtime.blocks import SlotBlocks
from deepinfer.runtime.request import Request, RequestOutput
from deepinfer.runtime.sampler import Features, History, PenaltyState, SamplerGraphs, pack, select_tokens
from deepinfer.runtime.scheduler import DecodeStep, PrefillStep, Scheduler, SchedulerConfig
from deepinfer.runtime.steps import ModelSteps
from deepinfer.serving.structured import Grammars, apply_masks


@dataclass
class RunStats:
    prompt_tokens: int = 0  # tokens run through prefill (recomputation after a preemption included)
    generated_tokens: int = 0
    decode_tokens: int = 0  # tokens produced by decode steps (a request's first token comes from prefill)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    decode_steps: int = 0
    preemptions: int = 0
    mask_seconds: float = 0.0  # structured-output masks (bitmask fill and application)
    first_token_time: float | None = None


class Engine:
    def __init__(self, steps: ModelSteps, cache: SlotBlocks, config: SchedulerConfig,
                 grammars: Grammars | None = None, max_len: int | None = None):
        """`max_len`: the longest sequence, prompt and output (default: what the model and cache allow)."""
        self.steps, self.cache, self.config, self.grammars = steps, cache, config, grammars
        self.eos = frozenset(steps.eos_token_ids)
        self.max_len = min(steps.max_positions, cache.spec.max_tokens, max_len or cache.spec.max_tokens)
        self.penalties = PenaltyState(cache.spec.max_seqs, steps.vocab_size, steps.device)
        self.sampler = self._sampler()

    def _sampler(self) -> SamplerGraphs | None:
        """Where decode steps replay graphs, their sampling replays one too (None: eager)."""
        capture = self.steps.capture
        return (SamplerGraphs(self.penalties, self.steps.vocab_size, self.cache.scratch_slot, capture)
                if capture is not None else None)

    @property
    def graphs(self):
        """DeepSeek-V4's decode graphs; None where the steps have none (DeepSeek-V4.1 decodes eagerly)."""
        return getattr(self.steps, "graphs", None)

    @graphs.setter
    def graphs(self, graphs) -> None:
        """Swap the decode graphs (tests run one engine eagerly and captured); the sampler follows their capture."""
        if not hasattr(self.steps, "graphs"):
            raise TypeError(f"{type(self.steps).__name__} has no decode graphs to swap: its decode steps run eagerly")
        self.steps.graphs = graphs
        self.sampler = self._sampler()

    @torch.inference_mode()
    def run(self, requests: list[Request], on_finish: Callable[[RequestOutput], None] | None = None,
            ) -> tuple[list[RequestOutput], RunStats]:
        stats, scheduler = RunStats(), Scheduler(self.cache, self.config, self.max_len)
        for r in requests:
            scheduler.add(r)
        outputs: dict[int, RequestOutput] = {}
        try:
            while scheduler.has_work():
                step = scheduler.next_step()
                if isinstance(step, PrefillStep):
                    self._prefill(step, stats)
                    active = [r for r, _ in step.chunks]
                else:
                    self._decode(step, stats)
                    active = list(step.requests)
                for r in active:
                    if r.finish_reason is not None and r in scheduler.running:
                        scheduler.finish(r)
                        outputs[r.index] = self._output(r)
                        if on_finish is not None:
                            on_finish(outputs[r.index])
        finally:  # an error mid-run must not leave slots and blocks taken in the cache the LLM keeps
            for r in list(scheduler.running):
                scheduler.finish(r)
        stats.preemptions = scheduler.preemptions
        stats.generated_tokens = sum(len(o.token_ids) for o in outputs.values())
        return [outputs[r.index] for r in requests], stats

    def _prefill(self, step: PrefillStep, stats: RunStats) -> None:
        ids, positions, seqs, logit_rows, sampling = [], [], [], [], []
        offset = 0
        for r, take in step.chunks:
            start = r.cached
            ids.extend(r.prefill_ids[start : start + take])
            positions.extend(range(start, start + take))
            seqs.append((r.cache, offset, take))
            offset += take
            if start + take == r.num_prefill and not r.generated:  # the prompt is in: sample token 1
                logit_rows.append(offset - 1)
                sampling.append(r)
        begin = time.perf_counter()
        logits = self.steps.prefill(ids, positions, seqs, logit_rows)
        if sampling:
            self._sample_and_append(sampling, logits, stats)
        stats.prefill_seconds += time.perf_counter() - begin
        stats.prompt_tokens += len(ids)
        if sampling and stats.first_token_time is None:
            stats.first_token_time = time.perf_counter()

    def _decode(self, step: DecodeStep, stats: RunStats) -> None:
        reqs = list(step.requests)
        if not reqs:
            return
        begin = time.perf_counter()
        logits = self.steps.decode([r.generated[-1] for r in reqs], [r.num_tokens - 1 for r in reqs],
                                   [r.cache for r in reqs])
        self._sample_and_append(reqs, logits, stats, decode=True)
        stats.decode_seconds += time.perf_counter() - begin
        stats.decode_steps += 1
        stats.decode_tokens += len(reqs)

    def _sample_and_append(self, reqs: list[Request], logits: torch.Tensor, stats: RunStats,
                           decode: bool = False) -> None:
        states = [r.constraint for r in reqs]
        if any(s is not None for s in states):
            begin = time.perf_counter()
            apply_masks(logits, states, self.grammars)
            stats.mask_seconds += time.perf_counter() - begin
        tokens = self._sample(reqs, logits, decode)
        now = time.perf_counter()
        for r, token in zip(reqs, tokens):
            r.generated.append(token)
            if r.first_token_time is None:
                r.first_token_time = now
            if r.constraint is not None:
                r.constraint.accept(token, self.grammars.think_end)
            if token in self.eos and not r.params.ignore_eos:
                r.output.push_stop_token()
                r.finish_reason = "stop"
                continue
            r.output.push(token)
            if r.output.stopped or (r.constraint is not None and r.constraint.done):
                r.finish_reason = "stop"
            elif len(r.generated) >= r.params.max_new_tokens or r.num_tokens >= self.max_len:
                r.finish_reason = "length"

    def _sample(self, reqs: list[Request], logits: torch.Tensor, decode: bool) -> list[int]:
        """One token per request: through the captured sampler after a graph-replayed decode step, else eagerly
        with only the stages the batch needs. Penalized requests' slots get their penalty rows first."""
        params = [r.params for r in reqs]
        seeds, positions = [r.seed for r in reqs], [r.num_tokens for r in reqs]
        slots = [r.cache.slot for r in reqs]
        features = Features.of(params)
        graph = decode and self.sampler is not None and (features.sampled or features.bias or features.penalties)
        if graph or features.penalties:  # the rows these steps count into
            self.penalties.prepare(slots, reqs, [History(r.prompt_ids, r.generated) if r.params.penalized else None
                                                 for r in reqs])
        if graph:
            return self.sampler.run(self.steps.last_logits, len(reqs), params, seeds, positions, slots)
        device = logits.device
        seen = index = None
        if features.penalties:
            index = torch.tensor(slots, device=device)
            seen = self.penalties.rows(index)
        tokens = select_tokens(logits, pack(params, seeds, positions, logits.shape[-1], device), seen, features)
        if features.penalties:
            self.penalties.record(index, tokens)
        return tokens.tolist()

    def _output(self, r: Request) -> RequestOutput:
        parsed = r.output.finish(r.finish_reason)
        r.finish_time = time.perf_counter()
        return RequestOutput(
            index=r.index,
            prompt=r.prompt_text,
            prompt_token_ids=list(r.prompt_ids),
            token_ids=list(r.generated),
            text=parsed["text"],
            reasoning_content=parsed["reasoning_content"],
            tool_calls=parsed["tool_calls"],
            finish_reason=parsed["finish_reason"],
            time_to_first_token=(r.first_token_time or r.finish_time) - r.arrival,
            latency=r.finish_time - r.arrival,
            preemptions=r.preemptions,
            response=parsed["response"] if r.custom_id is not None else None,
            chunks=r.output.chunks,
            custom_id=r.custom_id,
        )
