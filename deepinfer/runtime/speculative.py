"""Speculative decoding with DeepSeek-V4's MTP layer: draft k tokens, verify them in one target step.

A speculative decode step feeds each running request its last token and its draft tokens as consecutive rows of
one decode step (the decode graphs, sized for requests x (1 + k) rows; a prefill-like step beyond the largest),
so every row gets the target's logits. Row j's token is drawn
exactly as plain decoding draws the token at that position (`runtime/sampler.py`: the same masks, bias,
penalties over the tokens before it, and the uniform keyed by (seed, position)); the draft token at that
position is accepted when it equals it, and the first row whose token differs (or the last row: the bonus)
ends the request's step. So the output is token for token the output of plain decoding, greedy or seeded, for
any draft length and any batch (docs/speculative.md explains why this "match" verification is used instead of
the min(1, p/q) rejection rule, whose seeded outputs depend on the draft lengths). The cache then keeps the
positions whose tokens stayed (`model.rollback.commit`).

Drafting: the MTP layer catches up on the rows the target kept (their final streams and the token after each),
then drafts the next k tokens by running on its own output (`model.mtp`). A draft token is chosen from the
layer's logits as the target's token will be (argmax for greedy rows; the same keyed uniform for sampled rows,
so draft and target draws are coupled and agree whenever the two distributions are close).

Steps run synchronously (no decode step is launched ahead of the host); sampling and drafting run eagerly.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from deepinfer.runtime.logprobs import StepLogprobs
from deepinfer.runtime.request import Request
from deepinfer.runtime.sampler import Features, History, Seen, pack, select_tokens
from deepinfer.runtime.spec_budget import StepCosts, verify_budget
from deepinfer.serving.structured import apply_masks

if TYPE_CHECKING:
    from deepinfer.runtime.engine import Engine, RunStats


@dataclass
class SpecStats:
    """What the speculative steps did. Per draft position i: `reached[i]` drafts verified with every draft before
    them accepted, `accepted[i]` of those accepted (so `acceptance[i]` is the acceptance rate at position i given
    the ones before it stood)."""

    steps: int = 0
    request_steps: int = 0  # requests verified, summed over the steps
    verify_tokens: int = 0  # rows of the verify steps (each request's last token and its drafts)
    drafts: int = 0  # draft tokens verified
    reached: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)

    def count(self, verified: int, accepted: int) -> None:
        """One request's step: `verified` drafts, the first `accepted` of them accepted."""
        self.request_steps += 1
        self.drafts += verified
        reached = min(verified, accepted + 1)
        while len(self.reached) < reached:
            self.reached.append(0)
            self.accepted.append(0)
        for i in range(reached):
            self.reached[i] += 1
            self.accepted[i] += i < accepted

    @property
    def acceptance(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted, self.reached)]

    @property
    def mean_accepted(self) -> float:
        """Tokens a request gains per verify step (accepted drafts + the target's own token)."""
        return (sum(self.accepted) + self.request_steps) / self.request_steps if self.request_steps else 0.0


class Speculator:
    """Verifies the drafts of a `drafts` source (`runtime/drafters.py`) with the target, for an `Engine` over
    `V4Steps`: `tokens` drafts per request and step at most."""

    def __init__(self, steps, tokens: int, drafts, varlen: bool = False):
        """`varlen`: confidence-sized verification (`runtime/spec_budget.py`), else every draft is verified."""
        self.steps, self.model, self.cache, self.k, self.drafts = steps, steps.model, steps.cache, tokens, drafts
        graphs = steps.verify_graphs
        self.costs = StepCosts(graphs.buckets if graphs is not None else (1,)) if varlen else None

    def profile(self) -> None:
        """Start-up: the drafter's graphs captured (DSpark); confidence-sized verification: each captured verify
        bucket timed."""
        ready = getattr(self.drafts, "capture_all", None)
        if ready is not None:
            ready()
        graphs = self.steps.verify_graphs
        if self.costs is not None and graphs is not None:
            self.costs.profile(graphs.replays())

    def after_prefill(self, chunks: list[tuple[Request, int, int, int]], streams: torch.Tensor,
                      sampled: dict[int, int]) -> None:
        """`chunks`: (request, first position, rows, first row) of a prefill step; `sampled`: each request whose
        prompt completed -> its new token (not appended yet). The drafts source reads the step."""
        self.drafts.after_prefill(chunks, streams, sampled, self.k)

    # ---- a speculative decode step -----------------------------------------------------------------------
    def decode(self, engine: Engine, reqs: list[Request], stats: RunStats) -> list[Request]:
        """Verify every request's drafts, append the tokens that stand, keep their cache rows, draft again.
        Returns the requests that finished."""
        spec, begin = stats.spec, time.perf_counter()
        # (the scheduler has cut each request's drafts to its length limits and the blocks it holds)
        if self.costs is not None:  # confidence-sized: the drafts worth a place in this step, across the batch
            for r, n in zip(reqs, verify_budget([r.confidence[: len(r.drafts)] for r in reqs], self.costs,
                                                self.costs.steps)):
                r.drafts = r.drafts[:n]
        ids, positions, chunks, bases = [], [], [], []
        for r in reqs:
            base = r.num_tokens - 1
            drafts = r.drafts
            chunks.append((r.cache, len(ids), 1 + len(drafts)))
            ids += [r.generated[-1], *drafts]
            positions += range(base, base + 1 + len(drafts))
            bases.append(base)
        logits, streams = self.steps.verify(ids, positions, chunks)
        spec.steps += 1
        spec.verify_tokens += len(ids)
        stats.decode_steps += 1
        kept, accepted, done = self._accept(engine, reqs, chunks, logits, stats)
        for r, base, n, a in zip(reqs, bases, kept, accepted):
            self.steps.commit(r.cache, base + n)
            spec.count(len(r.drafts), a)
        stats.decode_tokens += sum(kept)
        ended = {id(r) for r in done}
        live = [(r, base, n, start) for r, base, n, (_, start, _) in zip(reqs, bases, kept, chunks)
                if id(r) not in ended]
        if live:
            self.drafts.after_verify(live, streams, self.k)
        if self.costs is not None:  # the whole step: verify, sampling, appending and drafting
            self.costs.record(len(ids), time.perf_counter() - begin)
        return done

    def _accept(self, engine: Engine, reqs: list[Request], chunks, logits: torch.Tensor, stats: RunStats):
        """Each request's tokens row by row until one differs from its draft (or the request finishes): how many
        each appended, how many of its drafts stood, and the requests that finished."""
        params = [r.params for r, (_, _, n) in zip(reqs, chunks) for _ in range(n)]
        asked = StepLogprobs.of(logits, params)
        free = [i for i, r in enumerate(reqs) if r.constraint is None]
        tokens = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
        if free:
            rows = [chunks[i][1] + j for i in free for j in range(chunks[i][2])]
            index = torch.tensor(rows, device=logits.device)
            tokens[index] = self._tokens(logits.index_select(0, index), [(reqs[i], j) for i in free
                                                                          for j in range(chunks[i][2])])
        host = tokens.tolist()

        def logprobs() -> list:  # each row's logprobs entry (None where it did not ask), for the tokens so far
            return asked.unpack(asked.pack(tokens).tolist(), host, len(host)) if asked is not None else [None] * len(host)

        lps = logprobs()
        kept, accepted, done = [], [], []
        for r, (_, start, n) in zip(reqs, chunks):
            for j in range(n):
                row = start + j
                if r.constraint is not None:  # masked after the tokens before it, so drawn one row at a time
                    begin = time.perf_counter()
                    apply_masks(logits[row : row + 1], [r.constraint], engine.grammars)
                    stats.mask_seconds += time.perf_counter() - begin
                    host[row] = int(self._tokens(logits[row : row + 1], [(r, 0)])[0])
                    tokens[row] = host[row]
                    if r.params.logprobs is not None:
                        lps = logprobs()
                finished = engine._append([r], [host[row]], [lps[row]])
                stood = j < n - 1 and host[row] == r.drafts[j]
                if finished or not stood:
                    kept.append(j + 1)
                    accepted.append(j + stood)  # a request ending on a row whose draft stood counts it
                    done += finished
                    break
        return kept, accepted, done

    def _tokens(self, logits: torch.Tensor, rows: list[tuple[Request, int]]) -> torch.Tensor:
        """The target's token for each (request, draft index) row, drawn as plain decoding draws it at that
        position (the penalties count the drafts before the row as generated)."""
        params = [r.params for r, _ in rows]
        features = Features.of(params)
        if not (features.sampled or features.bias or features.penalties):
            return logits.argmax(dim=-1)
        seen = None
        if features.penalties:
            seen = Seen.of([History(r.prompt_ids, r.generated + r.drafts[:j]) for r, j in rows], logits.shape[-1],
                           logits.device)
        packed = pack(params, [r.seed for r, _ in rows], [r.num_tokens + j for r, j in rows], logits.shape[-1],
                      logits.device)
        return select_tokens(logits, packed, seen, features)


def speculator(steps, tokens: int, varlen: bool = False) -> Speculator | None:
    """The engine's speculator: up to `tokens` drafts (DSpark's when the model has it, else the MTP layer's) per
    request and step, all verified or (`varlen`) as many as confidence-sized verification admits (None: plain
    decoding)."""
    if not tokens:
        return None
    from deepinfer.runtime.drafters import DSparkDrafts, MTPDrafts

    if steps.model.weights.dspark is not None:
        source = DSparkDrafts(steps.model, steps.cache, getattr(steps, "capture", None))
    else:
        source = MTPDrafts(steps.model, steps.cache)
    return Speculator(steps, tokens, source, varlen)
