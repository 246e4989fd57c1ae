"""Logprobs of a step's generated tokens, for the rows that ask (`SamplingParams.logprobs`).

They are log_softmax of the model's raw fp32 logits of the step: before the structured-output masks, logit_bias,
the penalties, the temperature and the top-k / top-p / min-p filters. They are computed on the logits' device from
the same logits tensor the sampler reads (so before the masks, which are applied to it in place), only for the
rows that asked and only when a row asked, and come back with the step's tokens in the same non-blocking copy
(`TokenReadback`): one [rows, 1 + 2k] float64 tensor (the sampled token's logprob, the top k logprobs, their
token ids; fp32 values and token ids are exact in float64). The top k are the k largest logprobs in descending
order, ties broken toward the lower token id (a stable sort), so the list is the same on every run.
"""

from __future__ import annotations

from typing import Sequence

import torch

from deepinfer.runtime.request import TokenLogprobs
from deepinfer.runtime.sampling import SamplingParams
from deepinfer.runtime.staging import upload


def top_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[R, V] logits -> (log_softmax [R, V] fp32, the top k logprobs [R, k], their token ids [R, k]): descending,
    ties toward the lower token id."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    if k == 0:
        empty = logprobs[:, :0]
        return logprobs, empty, empty.long()
    values, ids = torch.sort(logprobs, dim=-1, descending=True, stable=True)
    return logprobs, values[:, :k], ids[:, :k]


class StepLogprobs:
    """The logprobs a step's asking rows need, begun on the device from the step's logits (before any mask)."""

    def __init__(self, logits: torch.Tensor, rows: list[int], counts: list[int]):
        self.rows, self.counts = rows, counts
        n = logits.shape[0]
        self._index = None if rows == list(range(n)) else upload(torch.tensor(rows, dtype=torch.long), logits.device)
        picked = logits if self._index is None else logits.index_select(0, self._index)
        self._logprobs, self._top, self._ids = top_logprobs(picked, max(counts))

    @classmethod
    def of(cls, logits: torch.Tensor, params: Sequence[SamplingParams]) -> StepLogprobs | None:
        """None when no row asks (nothing is computed)."""
        rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        return cls(logits, rows, [params[i].logprobs for i in rows]) if rows else None

    def pack(self, tokens: torch.Tensor) -> torch.Tensor:
        """[rows, 1 + 2k] float64 on the device: each asking row's sampled token's logprob, top logprobs, top ids."""
        picked = tokens if self._index is None else tokens.index_select(0, self._index)
        sampled = self._logprobs.gather(1, picked[:, None].long())
        return torch.cat([sampled.double(), self._top.double(), self._ids.double()], dim=1)

    def unpack(self, packed: list[list[float]], tokens: Sequence[int], n: int) -> list[TokenLogprobs | None]:
        """The host copy of `pack`'s tensor -> one entry per row of the step (None for a row that did not ask)."""
        out: list[TokenLogprobs | None] = [None] * n
        k = (len(packed[0]) - 1) // 2 if packed else 0
        for row, count, values in zip(self.rows, self.counts, packed):
            top = [(int(values[1 + k + j]), values[1 + j]) for j in range(count)]
            out[row] = TokenLogprobs(int(tokens[row]), values[0], top)
        return out
