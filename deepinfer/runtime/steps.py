"""What the engine needs from a model: `ModelSteps`, the one interface both DeepSeek-V4 and V4.1 are driven
through (the cache side is `SlotBlocks`: admit, grow, release).

- `prefill(ids, positions, seqs, logit_rows)`: chunks of one or more sequences in one forward; `seqs` lists
  (sequence, first row, rows) of the flat ids/positions, each chunk continuing its sequence at its token count.
  Returns fp32 logits of `logit_rows`; advances each sequence's token count.
- `decode(ids, positions, seqs)`: one token per sequence; fp32 logits [n, V]; advances the token counts. `ids`
  are host ints or `DeviceIds` (the previous step's sampled tokens, under asynchronous scheduling).
- `capture_all()`: capture every decode-graph bucket now (start-up), where the steps capture at all; returns
  the buckets' logits buffers (the sampler captures over them).
- `capture`: the decode-graph capture the sampler may share (None: eager), `last_logits`: the bucket-sized
  logits buffer of the last replayed decode step.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import torch

from deepinfer.model.model import DeepseekV4
from deepinfer.model.rollback import check_tentative, commit
from deepinfer.runtime.blocks import SeqCache
from deepinfer.runtime.cache import PagedCache
from deepinfer.runtime.graph import DecodeGraphs
from deepinfer.runtime.staging import DeviceIds

Chunks = list[tuple[SeqCache, int, int]]


class ModelSteps(Protocol):
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_positions: int
    device: torch.device

    @property
    def capture(self) -> Callable[[Callable[[], Any]], tuple[Any, Callable[[], Any]]] | None: ...

    @property
    def last_logits(self) -> torch.Tensor | None: ...

    def prefill(self, ids: list[int], positions: list[int], seqs: Chunks, logit_rows: list[int]) -> torch.Tensor: ...

    def decode(self, ids: list[int] | DeviceIds, positions: list[int], seqs: list[SeqCache]) -> torch.Tensor: ...

    def capture_all(self) -> list[torch.Tensor]: ...


class SpeculativeSteps(ModelSteps, Protocol):
    """What the speculator (`runtime/speculative.py`) needs beyond `ModelSteps` (both models; not several ranks):
    `prefill(..., hidden=True)` also returns what the drafter reads, `verify` runs a request's last token and drafts
    as rows of one step and `commit` keeps what stands; `verify_graphs` (None: eager) gives their buckets' costs."""

    @property
    def verify_graphs(self) -> Any: ...

    def verify(self, ids: list[int], positions: list[int], seqs: Chunks) -> tuple[torch.Tensor, torch.Tensor]: ...

    def commit(self, seq: SeqCache, end: int) -> None: ...


class V4Steps:
    """DeepSeek-V4: prefill eagerly over the paged cache, decode through the decode graphs."""

    def __init__(self, model: DeepseekV4, cache: PagedCache, graphs: DecodeGraphs):
        self.model, self.cache, self.graphs = model, cache, graphs
        cfg = model.cfg
        self.vocab_size, self.eos_token_ids, self.max_positions = (cfg.vocab_size, tuple(cfg.eos_token_ids),
                                                                   cfg.max_position_embeddings)
        self.device = model.device

    @property
    def capture(self):
        return self.graphs.capture

    @property
    def last_logits(self) -> torch.Tensor | None:
        return self.graphs.last_logits

    def prefill(self, ids: list[int], positions: list[int], seqs: Chunks, logit_rows: list[int],
                hidden: bool = False):
        """`hidden`: also every row's final residual streams (for the MTP draft layer)."""
        device = self.device
        return self.model.prefill(self.cache, torch.tensor(ids, device=device), torch.tensor(positions, device=device),
                                  seqs, torch.tensor(logit_rows, dtype=torch.long, device=device), hidden=hidden)

    def capture_all(self) -> list[torch.Tensor]:
        return self.graphs.capture_all()

    @property
    def verify_graphs(self) -> DecodeGraphs:
        """The graphs verify steps replay (`buckets`, `replays()`: confidence-sized verification's costs)."""
        return self.graphs

    def verify(self, ids: list[int], positions: list[int], seqs: Chunks):
        """A speculative verify step: each (sequence, first row, rows) continues its sequence with its last token
        and drafts -> (fp32 logits of every row, their final streams or DSpark taps). Decode rows through the
        decode graphs up to their largest bucket, else a prefill-like step; tentative: `commit` keeps what stands."""
        graphs = self.graphs
        if len(ids) <= graphs.buckets[-1]:
            for _, _, n in seqs:
                check_tentative(n, self.cache.spec.lookahead)
            logits = graphs.run(ids, positions, [seq for seq, _, n in seqs for _ in range(n)])
            for seq, _, n in seqs:
                seq.num_tokens += n
            return logits, graphs.last_streams
        device = self.device
        return self.model.prefill(self.cache, torch.tensor(ids, device=device), torch.tensor(positions, device=device),
                                  seqs, None, hidden=True, tentative=True)

    def commit(self, seq: SeqCache, end: int) -> None:
        """Keep a verify step's positions before `end` (`model/rollback.py`)."""
        commit(seq, end)

    def decode(self, ids: list[int] | DeviceIds, positions: list[int], seqs: list[SeqCache], **run) -> torch.Tensor:
        """One decode step; `run`: `DecodeGraphs.run`'s options (several ranks: `rows=`, `eager=`)."""
        logits = self.graphs.run(ids, positions, seqs, **run)
        for s in seqs:
            s.num_tokens += 1
        return logits
