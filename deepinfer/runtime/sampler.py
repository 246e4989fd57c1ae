"""The batched sampler: logits [B, V] on their device -> one token per row, with tensor operations only.

In this order: `logit_bias` is added; `repetition_penalty` (over prompt and generated tokens: a positive logit
is divided by it, a negative one multiplied), `frequency_penalty` (times each token's count among the generated
tokens) and `presence_penalty` (once per generated token) are applied; greedy rows (temperature 0) take the
argmax; the others are scaled by their temperature, filtered by top-k, then top-p (on the top-k renormalised
distribution) and min-p (relative to the most likely token), and drawn.

A draw is keyed by (request seed, position of the token being drawn): one uniform from a counter-based hash
of the key is located in the row's cumulative distribution (inverse-CDF sampling), in vocabulary order for a
row without top-k / top-p / min-p and in descending-probability order for a row with them. No generator
state is kept, so a row's token depends on its own logits, parameters, seed and position only: the same
whatever it is batched with and however its prompt was chunked.

The per-row parameters go to the device as one packed tensor; `select_tokens` has no host synchronisation
and no data-dependent Python branch, so the decode step captures it into a CUDA graph (`SamplerGraphs`), with
every feature on: a feature a row does not use is an identity for that row (a zero bias, penalties of 0 and 1),
so the graph and the eager path give the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from deepinfer.runtime.sampling import MAX_LOGIT_BIAS, SamplingParams, draw_seed, uniform
from deepinfer.runtime.staging import InputStage, upload

_BELOW_ONE = 1.0 - 2.0**-24  # the largest fp32 below 1: a uniform never rounds up to 1 (past the last kept token)

# the columns of a batch's packed parameters
TEMP, TOPK, TOPP, MINP, REP, FREQ, PRES, U, GREEDY = range(9)
WIDTH = 9


@dataclass(frozen=True)
class Features:
    """Which stages a batch needs (the eager path skips the others; the graph runs them all)."""

    bias: bool
    penalties: bool
    sampled: bool
    filtered: bool

    @classmethod
    def of(cls, params: Sequence[SamplingParams]) -> Features:
        return cls(bias=any(p.logit_bias for p in params), penalties=any(p.penalized for p in params),
                   sampled=not all(p.greedy for p in params), filtered=any(p.filtered and not p.greedy for p in params))


ALL = Features(bias=True, penalties=True, sampled=True, filtered=True)


@dataclass(frozen=True)
class Packed:
    """A batch's parameters on the device: `knobs` [B, 9] fp32 (columns above), `bias_ids` / `bias` [B, N]
    (each row's logit_bias entries, padded with token 0 and bias 0)."""

    knobs: torch.Tensor
    bias_ids: torch.Tensor
    bias: torch.Tensor


def knob_rows(params: Sequence[SamplingParams], seeds: Sequence[int], positions: Sequence[int],
              vocab: int) -> list[list[float]]:
    """The batch's `knobs` rows on the host (each row's uniform drawn from its seed and position)."""
    return [[p.temperature if not p.greedy else 1.0, p.top_k if p.top_k > 0 else vocab, p.top_p, p.min_p,
             p.repetition_penalty, p.frequency_penalty, p.presence_penalty,
             0.0 if p.greedy else min(uniform(draw_seed(s, pos)), _BELOW_ONE), float(p.greedy)]
            for p, s, pos in zip(params, seeds, positions)]


def pack(params: Sequence[SamplingParams], seeds: Sequence[int], positions: Sequence[int], vocab: int,
         device: torch.device | str) -> Packed:
    """The batch's parameters (and each row's uniform) as device tensors."""
    knobs = knob_rows(params, seeds, positions, vocab)
    width = max((len(p.logit_bias) for p in params), default=0)
    ids = [[0] * width for _ in params]
    vals = [[0.0] * width for _ in params]
    for i, p in enumerate(params):
        for j, (token, b) in enumerate(p.logit_bias.items()):
            ids[i][j], vals[i][j] = token, b
    device = torch.device(device)
    return Packed(torch.tensor(knobs, dtype=torch.float32).to(device), torch.tensor(ids, dtype=torch.long).to(device),
                  torch.tensor(vals, dtype=torch.float32).to(device))


@dataclass(frozen=True)
class History:
    """What the penalties look at for one row: the prompt and the tokens generated so far."""

    prompt: Sequence[int]
    generated: Sequence[int]


@dataclass(frozen=True)
class Seen:
    """Per row of a batch, [B, V]: `counts` of each token among the generated ones (fp32) and `seen`, whether it
    is in the prompt or the generated tokens (bool)."""

    counts: torch.Tensor
    seen: torch.Tensor

    @classmethod
    def of(cls, histories: Sequence[History], vocab: int, device: torch.device | str) -> Seen:
        counts = torch.zeros(len(histories), vocab, dtype=torch.float32, device=device)
        seen = torch.zeros(len(histories), vocab, dtype=torch.bool, device=device)
        for i, h in enumerate(histories):
            _fill(counts[i], seen[i], h.prompt, h.generated)
        return cls(counts, seen)


def _fill(counts: torch.Tensor, seen: torch.Tensor, prompt: Sequence[int], generated: Sequence[int]) -> None:
    device = counts.device
    counts.zero_()
    seen.zero_()
    if generated:
        ids = torch.as_tensor(list(generated), dtype=torch.long).to(device)
        counts.index_add_(0, ids, torch.ones(ids.shape[0], dtype=counts.dtype, device=device))
        seen[ids] = True
    if prompt:
        seen[torch.as_tensor(list(prompt), dtype=torch.long).to(device)] = True


class PenaltyState:
    """`Seen` kept on the device per cache slot (one extra row for the scratch slot of padding rows). A slot's
    row is rebuilt when a penalized request samples there and the slot last served another request (from the
    prompt and the tokens generated so far, so a request recomputed after a preemption gets it back whole), and
    is advanced with one scatter per step."""

    def __init__(self, slots: int, vocab: int, device: torch.device | str):
        self.slots, self.vocab, self.device = slots, vocab, torch.device(device)
        self.counts: torch.Tensor | None = None
        self.seen: torch.Tensor | None = None
        self._owner: dict[int, object] = {}

    def allocate(self) -> None:
        if self.counts is None:
            self.counts = torch.zeros(self.slots + 1, self.vocab, dtype=torch.float32, device=self.device)
            self.seen = torch.zeros(self.slots + 1, self.vocab, dtype=torch.bool, device=self.device)

    def prepare(self, slots: Sequence[int], owners: Sequence[object], histories: Sequence[History | None]) -> None:
        """Claim each slot for its owner (every row about to be recorded); rebuild it when the owner is new and
        has a history (a penalty). A row claimed without a history holds counts no one reads."""
        self.allocate()
        for slot, owner, h in zip(slots, owners, histories):
            if self._owner.get(slot) is not owner:
                self._owner[slot] = owner
                if h is not None:
                    _fill(self.counts[slot], self.seen[slot], h.prompt, h.generated)

    def rows(self, index: torch.Tensor) -> Seen:
        return Seen(self.counts.index_select(0, index), self.seen.index_select(0, index))

    def record(self, index: torch.Tensor, tokens: torch.Tensor) -> None:
        """Count the tokens just sampled for the slots `index` [B] (device tensors; graph-capturable)."""
        flat = index * self.vocab + tokens
        self.counts.view(-1).scatter_add_(0, flat, torch.ones_like(flat, dtype=self.counts.dtype))
        self.seen.view(-1).scatter_(0, flat, True)


def adjust(logits: torch.Tensor, packed: Packed, seen: Seen | None, features: Features) -> torch.Tensor:
    """logit_bias and the penalties (a new tensor when either applies)."""
    if features.bias and packed.bias_ids.shape[1]:
        logits = logits.scatter_add(1, packed.bias_ids, packed.bias)
    if features.penalties:
        knobs = packed.knobs
        r = knobs[:, REP : REP + 1]
        logits = torch.where(seen.seen, torch.where(logits > 0, logits / r, logits * r), logits)
        logits = logits - knobs[:, FREQ : FREQ + 1] * seen.counts - knobs[:, PRES : PRES + 1] * (seen.counts > 0)
    return logits


def kept(ordered: torch.Tensor, knobs: torch.Tensor) -> torch.Tensor:
    """Temperature-scaled logits sorted descending [B, V] -> the probabilities after top-k, then top-p (on the
    top-k distribution) and min-p; dropped tokens are 0 (not renormalised)."""
    rank = torch.arange(ordered.shape[-1], device=ordered.device)[None, :]
    outside_k = rank >= knobs[:, TOPK : TOPK + 1]
    probs = torch.softmax(ordered.masked_fill(outside_k, float("-inf")), dim=-1)
    # top-p: drop a token when the tokens ranked above it already reach top_p (the first is always kept)
    drop = (torch.cumsum(probs, dim=-1) - probs) >= knobs[:, TOPP : TOPP + 1]
    drop |= probs < knobs[:, MINP : MINP + 1] * probs[:, :1]
    drop[:, 0] = False
    return probs.masked_fill(drop | outside_k, 0.0)


def _locate(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse CDF: per row of `probs` [B, V] (unnormalised), the index [B] where u [B, 1] of the mass falls."""
    cdf = torch.cumsum(probs, dim=-1, dtype=torch.float64)
    index = torch.searchsorted(cdf, u.double() * cdf[:, -1:], right=True)
    return index.clamp_(max=probs.shape[-1] - 1)[:, 0]


def select_tokens(logits: torch.Tensor, packed: Packed, seen: Seen | None, features: Features) -> torch.Tensor:
    """[B, V] fp32 logits -> [B] int64 tokens, on the logits' device, without a host synchronisation."""
    logits = adjust(logits, packed, seen, features)
    greedy = logits.argmax(dim=-1)
    if not features.sampled:
        return greedy
    knobs = packed.knobs
    scaled = logits / knobs[:, TEMP : TEMP + 1]
    u = knobs[:, U : U + 1]
    drawn = _locate(torch.softmax(scaled, dim=-1), u)
    if features.filtered:
        ordered, order = torch.sort(scaled, dim=-1, descending=True)
        filtered = order.gather(1, _locate(kept(ordered, knobs), u)[:, None])[:, 0]
        width = logits.shape[-1]
        is_filtered = (knobs[:, TOPK] < width) | (knobs[:, TOPP] < 1) | (knobs[:, MINP] > 0)
        drawn = torch.where(is_filtered, filtered, drawn)
    return torch.where(knobs[:, GREEDY] > 0, greedy, drawn)


def sample(logits: torch.Tensor, params: Sequence[SamplingParams], seeds: Sequence[int], positions: Sequence[int],
           seen: Seen | None = None) -> list[int]:
    """Eager: logits [B, V] fp32 -> one token per row. `positions[i]` is the position the new token will take;
    `seen` is needed when a row has a penalty."""
    features = Features.of(params)
    if features.penalties and seen is None:
        raise ValueError("penalties need each row's seen tokens (Seen)")
    packed = pack(params, seeds, positions, logits.shape[-1], logits.device)
    return select_tokens(logits, packed, seen, features).tolist()


def adjust_logits(logits: torch.Tensor, params: Sequence[SamplingParams], seen: Seen | None = None) -> torch.Tensor:
    """[B, V] logits after logit_bias and the penalties (what the sampler draws from, before temperature)."""
    packed = pack(params, [0] * len(params), [0] * len(params), logits.shape[-1], logits.device)
    return adjust(logits, packed, seen, Features.of(params))


def filter_logits(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """[B, V] fp32 logits -> temperature-scaled logits with the top-k / top-p / min-p rejected tokens at -inf
    (greedy rows unscaled): the set the sampler draws from, in vocabulary order."""
    knobs = pack(params, [0] * len(params), [0] * len(params), logits.shape[-1], logits.device).knobs
    logits = logits / knobs[:, TEMP : TEMP + 1]
    ordered, order = torch.sort(logits, dim=-1, descending=True)
    dropped = kept(ordered, knobs) == 0
    return logits.masked_fill(torch.zeros_like(dropped).scatter(1, order, dropped), float("-inf"))


@dataclass
class _Bucket:
    packed: Packed
    knobs: InputStage  # stages `packed.knobs`
    index: InputStage  # stages the slots' penalty rows [1, size]
    tokens: torch.Tensor
    replay: Callable[[], Any]
    bias_set: bool = False  # the bias buffers hold an earlier step's entries


class SamplerGraphs:
    """The decode step's sampler captured per batch-size bucket (every feature on), reading the bucket's logits
    buffer, the slots' penalty rows and the packed parameters copied into static buffers (through pinned
    memory, without waiting for the device), and counting the drawn tokens into the penalty state inside the
    same graph."""

    def __init__(self, state: PenaltyState, vocab: int, scratch_slot: int,
                 capture: Callable[[Callable[[], torch.Tensor]], tuple[torch.Tensor, Callable[[], Any]]]):
        self.state, self.vocab, self.scratch_slot, self.capture = state, vocab, scratch_slot, capture
        self._buckets: dict[int, _Bucket] = {}
        state.allocate()

    def prepare(self, logits: torch.Tensor) -> None:
        """Capture the sampler of the bucket whose logits buffer is `logits` (start-up), if not yet captured."""
        if logits.shape[0] not in self._buckets:
            self._buckets[logits.shape[0]] = self._capture(logits)

    def run(self, logits: torch.Tensor, n: int, params: Sequence[SamplingParams], seeds: Sequence[int],
            positions: Sequence[int], slots: Sequence[int]) -> torch.Tensor:
        """Tokens [n] (a device tensor, no host synchronisation) for the first n rows of the bucket-sized
        `logits` buffer (a static tensor); every slot of `slots` must have been prepared in the penalty state."""
        self.prepare(logits)
        b = self._buckets[logits.shape[0]]
        pad = logits.shape[0] - n
        b.knobs.send(knob_rows(list(params) + [SamplingParams(temperature=0)] * pad, list(seeds) + [0] * pad,
                               list(positions) + [0] * pad, self.vocab))
        entries = [(i, j, token, bias) for i, p in enumerate(params)
                   for j, (token, bias) in enumerate(p.logit_bias.items())]
        if b.bias_set:  # zero what an earlier step left
            b.packed.bias.zero_()
        if entries:  # one small copy of (row, column, token, bias) quadruples, scattered into the buffers
            quads = upload(torch.tensor(entries, dtype=torch.float64), logits.device)
            rows, cols = quads[:, 0].long(), quads[:, 1].long()
            b.packed.bias_ids[rows, cols] = quads[:, 2].long()
            b.packed.bias[rows, cols] = quads[:, 3].float()
        b.bias_set = bool(entries)
        b.index.send([list(slots) + [self.scratch_slot] * pad])
        b.replay()
        return b.tokens[:n]

    def _capture(self, logits: torch.Tensor) -> _Bucket:
        size, device = logits.shape[0], logits.device
        knobs = InputStage(size, WIDTH, device, torch.float32)
        packed = Packed(knobs.staged, torch.zeros(size, MAX_LOGIT_BIAS, dtype=torch.long, device=device),
                        torch.zeros(size, MAX_LOGIT_BIAS, device=device))
        packed.knobs[:, [TEMP, TOPK, TOPP, REP, GREEDY]] = torch.tensor([1.0, self.vocab, 1.0, 1.0, 1.0], device=device)
        index = InputStage(1, size, device)
        index.staged.fill_(self.scratch_slot)
        slots = index.staged[0]

        def step() -> torch.Tensor:
            tokens = select_tokens(logits, packed, self.state.rows(slots), ALL)
            self.state.record(slots, tokens)
            return tokens

        tokens, replay = self.capture(step)
        return _Bucket(packed, knobs, index, tokens, replay)
