"""The generation loop: the scheduler picks each step, the model runs it through `ModelSteps` (prefill chunks,
decode batches: DeepSeek-V4 or V4.1 alike); sampled tokens are appended and finished requests release their
cache.

Asynchronous scheduling (on by default, `SchedulerConfig.async_scheduling`): a decode step's sampled tokens stay
on the device (copied back without waiting, `TokenReadback`) and the next decode step is scheduled and launched
before the host reads them, feeding them on the device (`DeviceIds`); the host then appends step N's tokens,
detokenizes, checks stops and fills step N+1's grammar masks while the device runs step N+1's forward. A request
that finished at step N still has a row in step N+1 (computed, then dropped); its slot and blocks are released
only once step N+1 has landed, so no block a step in flight reads is freed or reused. Whenever the scheduler
could do anything but decode the same requests again (admit, prefill, preempt), the flight lands first and
scheduling proceeds as without overlap. Tokens depend only on each row's logits, parameters, seed and position,
so the outputs are the same either way wherever a row's logits do not depend on its batch (docs/serving.md).
The logprobs rows ask for (`runtime/logprobs.py`) are begun from the step's raw logits before sampling and come
back with its tokens, in the same copy."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from deepinfer.runtime.blocks import SlotBlocks
from deepinfer.runtime.logprobs import StepLogprobs
from deepinfer.runtime.request import Request, RequestOutput, TokenLogprobs
from deepinfer.runtime.sampler import Features, History, PenaltyState, SamplerGraphs, pack, select_tokens
from deepinfer.runtime.scheduler import PrefillStep, Scheduler, SchedulerConfig
from deepinfer.runtime.staging import DeviceIds, TokenReadback
from deepinfer.runtime.speculative import SpecStats, Speculator
from deepinfer.runtime.steps import ModelSteps
from deepinfer.serving.structured import Grammars, apply_masks


@dataclass
class RunStats:
    prompt_tokens: int = 0  # tokens run through prefill (recomputation after a preemption and SWA replay included)
    input_tokens: int = 0  # the requests' prompt tokens
    cached_tokens: int = 0  # of those, found in the prefix cache (each request's first admission)
    replayed_tokens: int = 0  # tokens prefilled again to rebuild sliding windows on prefix hits (approximate mode)
    generated_tokens: int = 0
    decode_tokens: int = 0  # tokens produced by decode steps (a request's first token comes from prefill)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    decode_steps: int = 0
    ahead_steps: int = 0  # decode steps launched before the host had seen the previous step's tokens
    dropped_rows: int = 0  # rows of those steps whose request had finished meanwhile (computed, then dropped)
    preemptions: int = 0
    mask_seconds: float = 0.0  # structured-output masks (bitmask fill and application)
    first_token_time: float | None = None
    expert_balance: float | None = None  # EPLB: max / mean tokens per rank, mean over the MoE layers
    expert_rebalances: int = 0  # EPLB: placements changed during the run
    spec: SpecStats = field(default_factory=SpecStats)  # speculative decoding (runtime/speculative.py)


@dataclass
class _Flight:
    """A decode step whose sampled tokens the host has not read yet."""

    requests: list[Request]
    tokens: torch.Tensor  # [n] on the device
    readback: TokenReadback
    logprobs: StepLogprobs | None = None  # the rows that asked for logprobs (their values come with the tokens)


class Engine:
    def __init__(self, steps: ModelSteps, cache: SlotBlocks, config: SchedulerConfig,
                 grammars: Grammars | None = None, max_len: int | None = None, speculator: Speculator | None = None):
        """`max_len`: the longest sequence, prompt and output (default: what the model and cache allow);
        `speculator`: decode speculatively (draft and verify several tokens per step; runtime/speculative.py)."""
        self.steps, self.cache, self.config, self.grammars = steps, cache, config, grammars
        self.speculator = speculator
        self.eos = frozenset(steps.eos_token_ids)
        self.max_len = min(steps.max_positions, cache.spec.max_tokens, max_len or cache.spec.max_tokens)
        self.penalties = PenaltyState(cache.spec.max_seqs, steps.vocab_size, steps.device)
        self.sampler = self._sampler()
        self._held: list[Request] = []  # finished, with a row in the step in flight: released when it lands

    def _sampler(self) -> SamplerGraphs | None:
        """Where decode steps replay graphs, their sampling replays one too (None: eager)."""
        capture = self.steps.capture
        return (SamplerGraphs(self.penalties, self.steps.vocab_size, self.cache.scratch_slot, capture)
                if capture is not None else None)

    def capture_all(self) -> None:
        """Capture every decode-graph bucket and its sampler now (start-up), where the steps capture at all."""
        for logits in self.steps.capture_all():
            if self.sampler is not None:
                self.sampler.prepare(logits)
        if self.speculator is not None:  # confidence-sized verification: each captured bucket's cost
            self.speculator.profile()

    @property
    def graphs(self):
        """DeepSeek-V4's decode graphs; None where the steps have none (DeepSeek-V4.1's are `steps.decode_graphs`)."""
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

        def finished(r: Request) -> None:
            outputs[r.index] = self._output(r)
            if on_finish is not None:
                on_finish(outputs[r.index])

        flight: _Flight | None = None
        try:
            while scheduler.has_work() or flight is not None:
                begin = time.perf_counter()
                if flight is not None:
                    flight = self._follow(flight, scheduler, stats, finished)
                else:
                    step = scheduler.next_step()
                    if isinstance(step, PrefillStep):
                        self._prefill(step, scheduler, stats, finished)
                        continue
                    if step.requests and self.speculator is not None:
                        self._speculate(list(step.requests), scheduler, stats, finished)
                    elif step.requests:
                        reqs = list(step.requests)
                        flight = self._launch(reqs, [r.generated[-1] for r in reqs], [r.num_tokens - 1 for r in reqs],
                                              stats)
                        if not self.config.async_scheduling:
                            self._land(flight, scheduler, stats, finished, None)
                            flight = None
                stats.decode_seconds += time.perf_counter() - begin
        finally:  # an error mid-run must not leave slots and blocks taken in the cache the LLM keeps
            held, self._held = self._held, []
            for r in list(scheduler.running):
                scheduler.finish(r)
            for r in held:
                scheduler.release(r)
        stats.preemptions = scheduler.preemptions
        stats.input_tokens = sum(len(r.prompt_ids) for r in requests)
        stats.cached_tokens = sum(r.num_cached_tokens or 0 for r in requests)
        stats.generated_tokens = sum(len(o.token_ids) for o in outputs.values())
        return [outputs[r.index] for r in requests], stats

    def _prefill(self, step: PrefillStep, scheduler: Scheduler, stats: RunStats, finished) -> None:
        ids, positions, seqs, logit_rows, sampling = [], [], [], [], []
        offset, starts = 0, []
        prefix = self.cache.prefix is not None
        for r, take in step.chunks:
            start = r.cached
            starts.append(start)
            if prefix:
                self.cache.plan_snapshots(r.cache, start, take, r.block_names[1] if r.block_names else ())
                stats.replayed_tokens += max(0, min(start + take, r.cache.shared_until) - start)
            ids.extend(r.prefill_ids[start : start + take])
            positions.extend(range(start, start + take))
            seqs.append((r.cache, offset, take))
            offset += take
            if start + take == r.num_prefill and not r.generated:  # the prompt is in: sample token 1
                logit_rows.append(offset - 1)
                sampling.append(r)
        begin = time.perf_counter()
        spec = self.speculator
        if spec is not None:
            logits, streams = self.steps.prefill(ids, positions, seqs, logit_rows, hidden=True)
        else:
            logits = self.steps.prefill(ids, positions, seqs, logit_rows)
        if prefix:
            for r, _ in step.chunks:
                self.cache.publish(r.cache, r.prompt_ids + r.generated)
        tokens = []
        if sampling:
            _, readback, asked = self._sample_step(sampling, logits, stats, decode=False)
            tokens = readback.tokens()
        if spec is not None:  # the draft layer reads the chunks, and drafts for the prompts that completed
            spec.after_prefill([(r, start, take, offset) for (r, take), (_, offset, _), start
                                in zip(step.chunks, seqs, starts)], streams,
                               {r.index: t for r, t in zip(sampling, tokens)})
        if sampling:
            for r in self._append(sampling, tokens, _logprobs(asked, readback, tokens)):
                scheduler.finish(r)
                finished(r)
        stats.prefill_seconds += time.perf_counter() - begin
        stats.prompt_tokens += len(ids)
        if sampling and stats.first_token_time is None:
            stats.first_token_time = time.perf_counter()

    def _speculate(self, reqs: list[Request], scheduler: Scheduler, stats: RunStats, finished) -> None:
        """A speculative decode step (synchronous): verify each request's drafts, keep what stands, draft again."""
        done = self.speculator.decode(self, reqs, stats)
        if self.cache.prefix is not None:
            self._publish([r for r in reqs if r.finish_reason is None])
        for r in done:
            scheduler.finish(r)
            finished(r)

    def _launch(self, reqs: list[Request], ids: list[int] | DeviceIds, positions: list[int], stats: RunStats,
                meanwhile: Callable[[], None] | None = None) -> _Flight:
        """A decode step's forward, then (after `meanwhile`: the host's work while the forward runs) its sampling,
        of the rows whose request has not finished meanwhile. The step's tokens stay on the device."""
        seqs = [r.cache for r in reqs]
        logits = self.steps.decode(ids, positions, seqs)
        stats.decode_steps += 1
        if self.cache.prefix_mode.mode == "exact":  # the window at block boundaries, kept while memory allows
            self.cache.snapshot_decode(seqs, positions)
        if meanwhile is not None:
            meanwhile()
        live = [r.finish_reason is None for r in reqs]
        stats.dropped_rows += live.count(False)
        return _Flight(reqs, *self._sample_step(reqs, logits, stats, decode=True, live=live))

    def _follow(self, flight: _Flight, scheduler: Scheduler, stats: RunStats, finished) -> _Flight | None:
        """With a step in flight: launch the next decode step of the same requests (fed the flight's tokens on the
        device), then land the flight while it runs, then sample it. Lands the flight alone (returns None) when the
        scheduler has anything else to do."""
        continuing = [r for r in flight.requests if r.finish_reason is None and not self._ends_after_next(r)]
        step = scheduler.decode_ahead(continuing) if continuing else None
        if step is None:
            self._land(flight, scheduler, stats, finished, None)
            return None
        reqs = list(step.requests)
        row = {id(r): i for i, r in enumerate(flight.requests)}
        stats.ahead_steps += 1
        return self._launch(reqs, DeviceIds(flight.tokens, [row[id(r)] for r in reqs]), [r.num_tokens for r in reqs],
                            stats, lambda: self._land(flight, scheduler, stats, finished, reqs))

    def _land(self, flight: _Flight, scheduler: Scheduler, stats: RunStats, finished,
              nxt: list[Request] | None) -> None:
        """Read a flight's tokens and append them; its finished requests leave, their cache released now, or when
        the step launched after it (`nxt`: its requests, which still have rows of theirs) lands."""
        tokens = flight.readback.tokens()
        held, self._held = self._held, []
        for r in held:  # the flight has landed: no step reads their blocks any more
            scheduler.release(r)
        rows = [i for i, r in enumerate(flight.requests) if r.finish_reason is None]
        stats.decode_tokens += len(rows)
        logprobs = _logprobs(flight.logprobs, flight.readback, tokens)
        landed = [flight.requests[i] for i in rows]
        done = self._append(landed, [tokens[i] for i in rows], [logprobs[i] for i in rows])
        if self.cache.prefix is not None:
            self._publish(landed)
        for r in done:
            scheduler.retire(r)
            if nxt is not None and r in nxt:
                self._held.append(r)
            else:
                scheduler.release(r)
            finished(r)

    def _publish(self, reqs: list[Request]) -> None:
        """Name the blocks the landed step's requests have filled (their tokens are all known once it landed)."""
        bt = self.cache.spec.block_tokens
        for r in reqs:
            seq = r.cache
            if min(seq.num_tokens, r.num_tokens) // bt > len(seq.names) or seq.pending:
                self.cache.publish(seq, r.prompt_ids + r.generated)

    def _ends_after_next(self, r: Request) -> bool:
        """Whether the request finishes on the token in flight whatever it is (its length limits)."""
        return len(r.generated) + 1 >= r.params.max_new_tokens or r.num_tokens + 1 >= self.max_len

    def _append(self, reqs: list[Request], tokens: list[int],
                logprobs: list[TokenLogprobs | None]) -> list[Request]:
        """Append each request's token (and its logprobs, when it asked; detokenize, stop checks, grammar advance);
        the requests that finished."""
        now, done = time.perf_counter(), []
        for r, token, lp in zip(reqs, tokens, logprobs):
            r.generated.append(token)
            if lp is not None:
                if r.logprobs is None:
                    r.logprobs = []
                r.logprobs.append(lp)
            if r.first_token_time is None:
                r.first_token_time = now
            if r.constraint is not None:
                r.constraint.accept(token, self.grammars.think_end)
            if token in self.eos and not r.params.ignore_eos:
                r.output.push_stop_token()
                r.finish_reason = "stop"
            else:
                r.output.push(token, lp)
                if r.output.stopped or (r.constraint is not None and r.constraint.done):
                    r.finish_reason = "stop"
                elif len(r.generated) >= r.params.max_new_tokens or r.num_tokens >= self.max_len:
                    r.finish_reason = "length"
            if r.finish_reason is not None:
                done.append(r)
        return done

    def _sample_step(self, reqs: list[Request], logits: torch.Tensor, stats: RunStats, decode: bool,
                     live: list[bool] | None = None) -> tuple[torch.Tensor, TokenReadback, StepLogprobs | None]:
        """The step's tokens [n] (a device tensor), their readback (with the logprobs of the rows that asked,
        begun from the raw logits before `_sample` masks them in place), and those rows."""
        asked = StepLogprobs.of(logits, [r.params for r in reqs])
        tokens = self._sample(reqs, logits, stats, decode, live)
        return tokens, TokenReadback(tokens, None if asked is None else asked.pack(tokens)), asked

    def _sample(self, reqs: list[Request], logits: torch.Tensor, stats: RunStats, decode: bool,
                live: list[bool] | None = None) -> torch.Tensor:
        """One token per row [n] (a device tensor): through the captured sampler after a graph-replayed decode
        step, else eagerly with only the stages the batch needs; the grammar masks of live constrained rows
        first (rows of requests that already finished are sampled unmasked and dropped). Penalized requests'
        slots get their penalty rows first."""
        states = [r.constraint if live is None or live[i] else None for i, r in enumerate(reqs)]
        if any(s is not None for s in states):
            begin = time.perf_counter()
            apply_masks(logits, states, self.grammars)
            stats.mask_seconds += time.perf_counter() - begin
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
        if not (features.sampled or features.bias or features.penalties):
            return logits.argmax(dim=-1)  # greedy: nothing to send
        device = logits.device
        seen = index = None
        if features.penalties:
            index = torch.tensor(slots, device=device)
            seen = self.penalties.rows(index)
        tokens = select_tokens(logits, pack(params, seeds, positions, logits.shape[-1], device), seen, features)
        if features.penalties:
            self.penalties.record(index, tokens)
        return tokens

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
            logprobs=list(r.logprobs or ()) if r.params.logprobs is not None else None,
            num_cached_tokens=r.num_cached_tokens or 0,
        )


def _logprobs(asked: StepLogprobs | None, readback: TokenReadback, tokens: list[int]) -> list[TokenLogprobs | None]:
    """One entry per row of a landed step: its logprobs, or None where the row did not ask."""
    if asked is None:
        return [None] * len(tokens)
    return asked.unpack(readback.extra(), tokens, len(tokens))
