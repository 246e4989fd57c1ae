"""Where speculative decoding's draft tokens come from (`runtime/speculative.py` verifies them).

A drafts source sets `Request.drafts` (the tokens it proposes for the positions after the request's last token)
after each step that leaves a request with a new last token:
- `after_prefill(chunks, streams, sampled, k)`: a prefill step ran `chunks` (request, first position, rows,
  first row of the step); `streams` are its rows' final residual streams; `sampled` maps each request whose
  prompt completed to its new token (not appended yet). Requests whose prefill completed get drafts.
- `after_verify(live, streams, k)`: a verify step kept `n` rows from position `base` for each (request, base, n,
  first row) of `live` (their tokens are appended); `streams` are the step's rows' final residual streams.
Each sets `Request.confidence` too: per draft, its estimated chance of acceptance given the drafts before it (the
MTP layer: its softmax probability of the token it drafted; the oracle: its acceptance probability), which
confidence-sized verification reads (`runtime/spec_budget.py`).

`MTPDrafts`: the model's MTP layer (`model/mtp.py`). `DSparkDrafts`: its DSpark drafter (`model/dspark.py`; V4.1's
`model/v41_dspark.py`): the
kept rows' tapped streams go into the draft blocks' window rings, then one block pass drafts k tokens (its
confidence head gives the confidences). `OracleDrafts`: a benchmark and test source that proposes a
known continuation of each request (the target's own greedy tokens) with each draft kept with probability p
and replaced by a wrong token otherwise, so that acceptance is set from outside (random weights accept nothing).
"""

from __future__ import annotations

import torch

from deepinfer.model.dspark import DSparkDrafter
from deepinfer.model.mtp import MTPDrafter, draft_share, rollback_chain
from deepinfer.runtime.request import Request
from deepinfer.runtime.sampler import Features, pack, select_tokens
from deepinfer.runtime.sampling import draw_seed, uniform


class MTPDrafts:
    """Drafts with the MTP layer: it reads every row the target keeps, then runs on its own output k - 1 times."""

    def __init__(self, model, cache):
        self.cache, self.drafter = cache, MTPDrafter(model)

    def after_prefill(self, chunks, streams: torch.Tensor, sampled: dict[int, int], k: int) -> None:
        rows, next_ids, positions, seqs, last = [], [], [], [], []
        for r, start, take, offset in chunks:
            share = draft_share(r.cache, start)
            nxt = r.prefill_ids[start + 1 : start + take + 1]
            if len(nxt) < take:  # the chunk ends the prefill: its last row's next token is the newest one
                nxt.append(sampled.get(r.index, r.generated[-1] if r.generated else 0))
            seqs.append((share, len(rows), take))
            rows.extend(range(offset, offset + take))
            next_ids.extend(nxt)
            positions.extend(range(start, start + take))
            if start + take == r.num_prefill:  # the prefill is in: draft from its last row
                last.append((r, len(rows) - 1))
        self._read(rows, next_ids, positions, seqs, last, streams, k)

    def after_verify(self, live, streams: torch.Tensor, k: int) -> None:
        rows, next_ids, positions, seqs, last = [], [], [], [], []
        for r, base, n, start in live:
            share = draft_share(r.cache, base)
            seqs.append((share, len(rows), n))
            rows.extend(range(start, start + n))
            next_ids.extend(r.generated[-n:])  # the tokens after the kept rows: what the step appended
            positions.extend(range(base, base + n))
            last.append((r, len(rows) - 1))
        self._read(rows, next_ids, positions, seqs, last, streams, k)

    def _read(self, rows, next_ids, positions, seqs, last, streams: torch.Tensor, k: int) -> None:
        """Run the layer over the rows (kept), then draft for the requests of `last` from their last row."""
        if not rows:
            return
        device = streams.device
        logit_rows = torch.tensor([i for _, i in last], dtype=torch.long, device=device)
        logits, out = self.drafter.forward(self.cache, streams[torch.tensor(rows, device=device)],
                                           torch.tensor(next_ids, device=device),
                                           torch.tensor(positions, device=device), seqs, logit_rows)
        if last:
            self._chain([r for r, _ in last], logits, out[logit_rows], [positions[i] + 2 for _, i in last], k)

    def _chain(self, reqs: list[Request], logits: torch.Tensor, streams: torch.Tensor, first: list[int],
               k: int) -> None:
        """k drafts per request from the layer's logits for position `first` [R] and its output streams there,
        running the layer on its own output (tentatively: rolled back after) for the later ones."""
        device = streams.device
        drafts: list[list[int]] = [[] for _ in reqs]
        confidence: list[list[float]] = [[] for _ in reqs]
        shares = [r.cache.draft for r in reqs]
        ends = [s.num_tokens for s in shares]
        for step in range(k):
            tokens = draws(reqs, logits, [p + step for p in first])
            sure = torch.softmax(logits.float(), dim=-1).gather(1, tokens.view(-1, 1))[:, 0]
            for d, c, t, p in zip(drafts, confidence, tokens.tolist(), sure.tolist()):
                d.append(t)
                c.append(p)
            if step == k - 1:
                break
            positions = torch.tensor([p + step - 1 for p in first], device=device)
            logits, streams = self.drafter.forward(self.cache, streams, tokens, positions,
                                                   [(s, i, 1) for i, s in enumerate(shares)], None)
        rollback_chain(shares, ends)
        for r, d, c in zip(reqs, drafts, confidence):
            r.drafts, r.confidence = d, c


class DSparkDrafts:
    """Drafts with DSpark: the draft blocks read every row the target keeps, then one pass drafts a block."""

    def __init__(self, model, cache, capture=None):
        """`capture`: the backend's graph capture (the block pass of each request-count bucket replays a graph);
        None: eager."""
        from deepinfer.model.v41 import DeepseekV41
        from deepinfer.model.v41_dspark import V41DSparkDrafter
        from deepinfer.runtime.draft_graphs import DSparkGraphs

        drafter = V41DSparkDrafter if isinstance(model, DeepseekV41) else DSparkDrafter
        self.cache, self.drafter = cache, drafter(model)
        self.graphs = DSparkGraphs(self.drafter, cache, cache.spec.max_seqs, capture) if capture else None

    def capture_all(self) -> None:
        """Capture the block pass's graphs now (start-up; nothing where it runs eagerly)."""
        if self.graphs is not None:
            self.graphs.capture_all()

    def after_prefill(self, chunks, taps: torch.Tensor, sampled: dict[int, int], k: int) -> None:
        rows, positions, seqs, anchors = [], [], [], []
        for r, start, take, offset in chunks:
            seqs.append((draft_share(r.cache, start), len(rows), take))
            rows.extend(range(offset, offset + take))
            positions.extend(range(start, start + take))
            if start + take == r.num_prefill:  # the prefill is in: its new token is the anchor
                anchors.append((r, sampled.get(r.index, r.generated[-1] if r.generated else 0), start + take))
        self._read(rows, positions, seqs, taps)
        self._draft(anchors, k)

    def after_verify(self, live, taps: torch.Tensor, k: int) -> None:
        rows, positions, seqs = [], [], []
        for r, base, n, start in live:
            seqs.append((draft_share(r.cache, base), len(rows), n))
            rows.extend(range(start, start + n))
            positions.extend(range(base, base + n))
        self._read(rows, positions, seqs, taps)
        self._draft([(r, r.generated[-1], base + n) for r, base, n, _ in live], k)

    def _read(self, rows, positions, seqs, taps: torch.Tensor) -> None:
        if rows:
            device = taps.device
            self.drafter.read(self.cache, taps[torch.tensor(rows, device=device)],
                              torch.tensor(positions, device=device), seqs)

    def _draft(self, anchors: list[tuple[Request, int, int]], k: int) -> None:
        """A block per (request, anchor token, its position): the first k drafts and their confidences."""
        if not anchors:
            return
        reqs = [r for r, _, _ in anchors]
        device = self.drafter.model.device
        first = [p + 1 for _, _, p in anchors]  # draft i is for position anchor + 1 + i
        ids, positions, shares = [t for _, t, _ in anchors], [p for _, _, p in anchors], [r.cache.draft for r in reqs]

        def choose(logits: torch.Tensor, i: int) -> torch.Tensor:
            return draws(reqs, logits, [p + i for p in first])

        if self.graphs is None:
            tokens, confidence = self.drafter.draft(self.cache, torch.tensor(ids, device=device),
                                                    torch.tensor(positions, device=device), shares, choose)
        else:
            logits, collapsed, tokens, confidence = self.graphs.run(ids, positions, shares)
            if not greedy(reqs):  # the graph's greedy drafts do not hold: redraw from the base logits
                tokens, confidence = self.drafter.markov(logits, collapsed, torch.tensor(ids, device=device),
                                                         choose)
        for r, d, c in zip(reqs, tokens[:, :k].tolist(), confidence[:, :k].tolist()):
            r.drafts, r.confidence = d, c


def greedy(reqs: list[Request]) -> bool:
    """Whether every request's draft is the argmax (no sampled request, no logit bias; penalties do not apply)."""
    features = Features.of([r.params for r in reqs])
    return not (features.sampled or features.bias)


def draws(reqs: list[Request], logits: torch.Tensor, positions: list[int]) -> torch.Tensor:
    """A draft token per request at `positions` from draft logits [R, V]: as the target will draw there (argmax
    for greedy rows; the same (seed, position) uniform for sampled ones), without the penalties."""
    if greedy(reqs):
        return logits.argmax(dim=-1)
    params = [r.params for r in reqs]
    features = Features.of(params)
    features = Features(bias=features.bias, penalties=False, sampled=features.sampled, filtered=features.filtered)
    return select_tokens(logits, pack(params, [r.seed for r in reqs], positions, logits.shape[-1], logits.device),
                         None, features)


class OracleDrafts:
    """Proposes `continuations[request index]` (the tokens after its prompt), each draft right with probability
    `accept` and otherwise replaced by another token (which the target rejects), keyed by (seed, position); its
    confidence is that probability (calibrated by construction). With `concentration` each draft's probability is
    drawn instead (one stream per (seed, request), indexed by position) from a Beta distribution of mean `accept`
    and that concentration (a + b): the acceptance at each position stays `accept` on average, and the
    confidences tell the likely drafts from the unlikely ones, as a trained confidence head does."""

    def __init__(self, continuations: dict[int, list[int]], accept: float, vocab: int, seed: int = 0,
                 concentration: float | None = None):
        if concentration is not None and not (concentration > 0 and 0 < accept < 1):
            raise ValueError(f"concentration={concentration} needs a positive concentration and 0 < accept < 1 "
                             f"(got accept={accept})")
        self.continuations, self.accept, self.vocab, self.seed = continuations, accept, vocab, seed
        self.concentration = concentration
        self._chances: dict[int, list[float]] = {}  # by request index: each position's probability

    def after_prefill(self, chunks, streams, sampled: dict[int, int], k: int) -> None:
        for r, start, take, _ in chunks:
            if start + take == r.num_prefill:
                self._propose(r, start + take + 1, k)

    def after_verify(self, live, streams, k: int) -> None:
        for r, base, n, _ in live:
            self._propose(r, base + n + 1, k)

    def _chance(self, r: Request, pos: int) -> float:
        if self.concentration is None:
            return self.accept
        chances = self._chances.get(r.index)
        if chances is None or pos >= len(chances):
            import numpy as np

            n = max(2 * pos, len(r.prompt_ids) + len(self.continuations.get(r.index, [])) + 64)
            a, b = self.concentration * self.accept, self.concentration * (1 - self.accept)
            chances = np.random.default_rng([self.seed, r.index]).beta(a, b, size=n).tolist()
            self._chances[r.index] = chances
        return chances[pos]

    def _propose(self, r: Request, first: int, k: int) -> None:
        known = self.continuations.get(r.index, [])
        drafts, confidence = [], []
        for pos in range(first, first + k):
            i = pos - len(r.prompt_ids)
            token = known[i] if 0 <= i < len(known) else 0
            chance = self._chance(r, pos)
            if uniform(draw_seed(self.seed * 1_000_003 + r.index, pos)) >= chance:
                token = (token + 1) % self.vocab  # a wrong guess
            drafts.append(token)
            confidence.append(chance)
        r.drafts, r.confidence = drafts, confidence
