"""The routed experts under expert parallelism, with EPLB.

Physical expert slots are spread evenly over all ranks (rank r holds slots [r S, (r+1) S)); a placement maps each
slot to a logical expert (`eplb.Placement`: contiguous, one replica each, without EPLB). Each MoE layer, the data-
parallel ranks' tokens (and their routing) are gathered, padded to the largest rank's count, so that every rank
sees every token; each (token, logical expert) pair goes to one replica (`eplb.route`: by token id, so the same
token takes the same replica in any batch); each rank runs its own slots over the pairs routed to them (the others
weigh zero), the partial outputs are summed over all ranks, and each rank keeps its own rows. Gather and sum keep
every shape static per step (no per-expert row counts cross the ranks).

With EPLB on, every rank counts the tokens its own requests route to each logical expert; every `step_interval`
forward passes (the same on every rank: data-parallel ranks step together) the counts are summed over the data-
parallel ranks, a new placement is computed (the same on every rank: deterministic), and each rank takes the
weights of its new slots from the ranks that held them (an all-gather of one layer's slots at a time).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.errors import ConfigError
from deepinfer.parallel import eplb
from deepinfer.parallel.comm import Comm
from tilekernels import OpTable
from tilekernels.quant import BlockQuantized


@dataclass(frozen=True)
class EplbConfig:
    redundant_experts: int = 0  # physical slots beyond one per logical expert (replicas of the hottest)
    step_interval: int = 1000  # forward passes between rebalances (0: never during a run)

    def __post_init__(self) -> None:
        for name in ("redundant_experts", "step_interval"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"eplb {name}={value!r} is invalid; accepted: an integer >= 0")


def initial_placement(layers: int, experts: int, ranks: int, eplb_cfg: EplbConfig | None) -> eplb.Placement:
    """The placement a run starts with: contiguous without redundant slots; with them (no loads counted yet) the
    EPLB placement of even loads (the redundant slots go to the first experts). ConfigError when the slots do not
    divide over the ranks."""
    slots = experts + (eplb_cfg.redundant_experts if eplb_cfg else 0)
    if slots % ranks:
        raise ConfigError(f"{experts} routed experts + {slots - experts} redundant = {slots} slots do not divide "
                          f"over {ranks} ranks; choose --eplb-redundant-experts so that they do")
    if slots == experts:
        return eplb.contiguous(layers, experts, ranks)
    return eplb.place(torch.ones(layers, experts), slots, ranks)


def slot_experts(placement: eplb.Placement, rank: int, layer: int) -> list[int]:
    """The logical experts of `rank`'s slots in `layer`, in slot order."""
    per = placement.slots_per_rank
    return placement.phy2log[layer, rank * per:(rank + 1) * per].tolist()


class ExpertShard:
    def __init__(self, ops: OpTable, comm: Comm, placement: eplb.Placement, gate_up: list, down: list,
                 eplb_cfg: EplbConfig | None):
        """`gate_up` / `down`: every layer's weights of this rank's slots under `placement` ([S, ...] each)."""
        self.ops, self.comm, self.eplb_cfg, self.placement = ops, comm, eplb_cfg, placement
        self.ranks, self.per_rank = placement.ranks, placement.slots_per_rank
        self.loads = (torch.zeros(placement.replicas.shape, dtype=torch.int64, device=comm.device)
                      if eplb_cfg is not None else None)
        self._place_tables()
        self.gate_up, self.down = list(gate_up), list(down)
        self.forwards = self.rebalances = 0
        self.static = False  # every data-parallel rank brings the same rows (a decode bucket): no size exchange

    def __call__(self, layer: int, ids: torch.Tensor, x: torch.Tensor, weights: torch.Tensor,
                 indices: torch.Tensor, limit: float) -> torch.Tensor:
        """Layer `layer`'s routed experts for this rank's rows `x` [n, H] (token ids `ids`, routing `weights` /
        logical `indices` [n, k]) -> [n, H]."""
        comm, n = self.comm, x.shape[0]
        if layer == 0:
            self._step()
        weights, indices, ids = weights.float(), indices.long(), ids.long()  # one dtype on every rank (idle ones too)
        if self.loads is not None:
            self.loads[layer].index_add_(0, indices.reshape(-1), torch.ones_like(indices.reshape(-1)))
        start, (x, weights, indices, ids) = gather_rows(comm, n, (x, weights, indices, ids), self.static)
        count = self._replicas[layer][indices]
        slot = self._log2phy[layer][indices, ids.view(-1, 1) % count] - comm.rank.rank * self.per_rank
        mine = (slot >= 0) & (slot < self.per_rank)
        out = self.ops.moe_experts(x, torch.where(mine, weights, torch.zeros_like(weights)),
                                   torch.where(mine, slot, torch.zeros_like(slot)), self.gate_up[layer],
                                   self.down[layer], limit)
        return comm.world_sum(out)[start:start + n]

    def idle(self, layers: int, hidden: int, top_k: int, limit: float, dtype: torch.dtype) -> None:
        """A forward pass without tokens: every layer's exchange with the other ranks (a data-parallel rank with
        nothing to run while others step)."""
        x = torch.zeros((0, hidden), dtype=dtype, device=self.comm.device)
        weights, indices = x.new_zeros((0, top_k), dtype=torch.float32), x.new_zeros((0, top_k), dtype=torch.int64)
        for layer in range(layers):
            self(layer, indices[:, 0], x, weights, indices, limit)

    def balance(self) -> float | None:
        """max / mean tokens per rank under the current placement, averaged over the layers, of the loads counted
        since the last rebalance (every rank takes part: a collective); None without EPLB or before any token."""
        if self.loads is None:
            return None
        loads = self._summed()
        if not loads.any():
            return None
        return float(eplb.balance(self.placement, loads).mean())

    # ---- internals ----------------------------------------------------------------------------------
    def _step(self) -> None:
        """Count a forward pass; rebalance every `step_interval` of them."""
        self.forwards += 1
        interval = self.eplb_cfg.step_interval if self.eplb_cfg is not None else 0
        if interval and self.forwards % interval == 0:
            self._rebalance()

    def _summed(self) -> torch.Tensor:
        """The loads of every data-parallel rank (tensor-parallel ranks count the same tokens once), on the host."""
        loads = self.loads.clone()
        if self.comm.dp > 1:
            torch.distributed.all_reduce(loads, group=self.comm.dp_group)
        return loads.cpu()

    def _rebalance(self) -> None:
        loads = self._summed()
        if not loads.any():
            return
        slots = self.placement.phy2log.shape[1]
        old = self.placement
        self.placement = eplb.place(loads, slots, self.ranks)
        self._place_tables()
        self.gate_up = [self._moved(w, old, i) for i, w in enumerate(self.gate_up)]
        self.down = [self._moved(w, old, i) for i, w in enumerate(self.down)]
        self.loads.zero_()
        self.rebalances += 1

    def _place_tables(self) -> None:
        device = self.comm.device
        self._log2phy = self.placement.log2phy.clamp(min=0).to(device)
        self._replicas = self.placement.replicas.to(device)

    def _moved(self, local, old: eplb.Placement, layer: int):
        """This rank's new slots, from every rank's old ones (an all-gather over the world)."""
        everyone = _gather_all(self.comm, local)  # [ranks * per_rank, ...] in old slot order
        first = old.log2phy[layer, :, 0]  # a slot that held each logical expert
        mine = torch.tensor(slot_experts(self.placement, self.comm.rank.rank, layer))
        return rows(everyone, first[mine])


def rows(w, index: torch.Tensor):
    """Experts `index` of a stacked weight (plain or block-quantized), copied."""
    return w[index.to(w.device)]


def _gather_all(comm: Comm, w):
    if isinstance(w, BlockQuantized):
        return BlockQuantized(_gather_all(comm, w.values), _gather_all(comm, w.scales), w.block, w.format)
    raw = w.contiguous().view(torch.uint8)  # as bytes: every dtype crosses every backend (FP8 included)
    parts = [torch.empty_like(raw) for _ in range(comm.rank.parallel.world)]
    torch.distributed.all_gather(parts, raw, group=comm.world)
    return torch.cat(parts).view(w.dtype)


def gather_rows(comm: Comm, n: int, tensors: tuple, static: bool = False) -> tuple[int, tuple]:
    """Every data-parallel rank's rows of `tensors` (this rank's `n` each), each rank's padded to the largest
    rank's count (`static`: every rank brings `n`, no size exchange), in rank order; and where this rank's rows
    start among them."""
    if comm.dp == 1:
        return 0, tensors
    rows = n if static else max(comm.dp_sizes(n))
    return comm.rank.dp_rank * rows, tuple(comm.dp_gather(pad_rows(t, rows)) for t in tensors)


def pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """`t` with zero rows appended up to `rows`."""
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros((rows - t.shape[0], *t.shape[1:]))], dim=0)
