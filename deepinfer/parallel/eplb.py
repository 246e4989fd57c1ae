"""Expert-parallel load balancing (EPLB): from per-expert token counts recorded during runs, a placement of the
routed experts on `num_physical` expert slots spread evenly over the ranks, with the hottest experts replicated
(`num_physical - num_experts` redundant slots), so that the most loaded rank carries close to the mean load.

DeepSeek's hierarchical policy, written from its description:
1. expert groups (the gate's `n_group`; 1 when the model has none) are packed onto nodes, each node the same number
   of groups, the heaviest groups first into the lightest node (groups stay whole: group-limited routing then keeps a
   token's experts on few nodes);
2. within each node its experts get the node's slots: one replica each, then every spare slot to the expert whose
   load per replica is the largest;
3. the node's replicas (each carrying its expert's load / replica count) are packed onto the node's ranks, each rank
   the same number of slots, heaviest replica first into the lightest rank.
With one node (or groups that do not divide over the nodes) the same steps run with a single node: the global policy.

A placement is a physical -> logical map per layer (`phy2log`, slot s lives on rank s // slots_per_rank) and its
inverse (`log2phy`, -1 padded): a token routed to logical expert e goes to one of e's replicas (`route`). The hash-
routed layers' table (token id -> logical experts) is remapped the same way (`remap_table`). Pure torch on the CPU,
deterministic (ties broken by index).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.errors import ConfigError


@dataclass(frozen=True)
class Placement:
    """Expert placement of every MoE layer: `phy2log` [L, P] (the logical expert in each physical slot; slot s on
    rank s // (P / ranks)), `log2phy` [L, E, R] (the slots holding each logical expert, -1 padded), `replicas`
    [L, E] (how many)."""

    phy2log: torch.Tensor
    log2phy: torch.Tensor
    replicas: torch.Tensor
    ranks: int

    @property
    def slots_per_rank(self) -> int:
        return self.phy2log.shape[1] // self.ranks


def balanced_packing(weights: torch.Tensor, packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Items [L, n] (n a multiple of `packs`) into `packs` packs of n / packs items each, per row: items by weight,
    heaviest first, each into the lightest pack that has room. -> (pack of each item, its index in the pack)."""
    rows, n = weights.shape
    if n % packs:
        raise ConfigError(f"EPLB: {n} items do not pack evenly into {packs} packs")
    per_pack = n // packs
    pack = torch.empty(rows, n, dtype=torch.long)
    index = torch.empty(rows, n, dtype=torch.long)
    for r in range(rows):
        load = [0.0] * packs
        count = [0] * packs
        for item in sorted(range(n), key=lambda i: (-float(weights[r, i]), i)):
            p = min((p for p in range(packs) if count[p] < per_pack), key=lambda p: (load[p], p))
            pack[r, item], index[r, item] = p, count[p]
            load[p] += float(weights[r, item])
            count[p] += 1
    return pack, index


def replicate(weights: torch.Tensor, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Experts [L, n] onto `slots` >= n slots per row: one replica each, then every spare slot to the expert with
    the largest load per replica. -> (expert of each slot [L, slots], replica count per expert [L, n]); slot i < n
    holds expert i, the spare slots follow in the order they were given."""
    rows, n = weights.shape
    if slots < n:
        raise ConfigError(f"EPLB: {slots} slots cannot hold {n} experts")
    phy = torch.empty(rows, slots, dtype=torch.long)
    phy[:, :n] = torch.arange(n)
    counts = torch.ones(rows, n, dtype=torch.long)
    for s in range(n, slots):
        per_replica = weights.double() / counts
        hottest = per_replica.argmax(dim=1)  # the first index on ties
        phy[:, s] = hottest
        counts[torch.arange(rows), hottest] += 1
    return phy, counts


def place(loads: torch.Tensor, num_physical: int, ranks: int, groups: int = 1, nodes: int = 1) -> Placement:
    """The hierarchical placement of `loads` [L, E] (tokens per logical expert per layer) on `num_physical` slots
    over `ranks` ranks in `nodes` nodes; `groups` expert groups. Falls back to the global policy (one node) when the
    groups do not divide over the nodes."""
    layers, experts = loads.shape
    for what, value in (("ranks", ranks), ("nodes", nodes), ("groups", groups)):
        if value < 1:
            raise ConfigError(f"EPLB: {what} must be at least 1, got {value}")
    if num_physical % ranks or ranks % nodes or experts % groups:
        raise ConfigError(f"EPLB: {num_physical} physical experts over {ranks} ranks in {nodes} nodes, {experts} "
                          f"experts in {groups} groups: the slots must divide over the ranks, the ranks over the "
                          "nodes and the experts over the groups")
    if num_physical < experts:
        raise ConfigError(f"EPLB: {num_physical} physical slots cannot hold {experts} experts")
    if groups % nodes or num_physical % nodes:
        groups, nodes = 1, 1
    w = loads.double()
    group_size, node_slots = experts // groups, num_physical // nodes
    # 1. groups onto nodes; `order` lists the logical experts node by node (node n: positions n*E/nodes ...)
    group_node, group_index = balanced_packing(w.view(layers, groups, group_size).sum(-1), nodes)
    group_pos = group_node * (groups // nodes) + group_index  # [L, groups]: position of each group
    expert_pos = (group_pos.unsqueeze(-1) * group_size + torch.arange(group_size)).view(layers, experts)
    order = torch.argsort(expert_pos, dim=1)  # order[l, p] = the expert at position p
    node_w = w.gather(1, order).view(layers * nodes, experts // nodes)
    # 2. each node's experts onto its slots
    node_phy, counts = replicate(node_w, node_slots)  # node-local expert index per slot
    # 3. each node's replicas onto its ranks
    per_replica = node_w.gather(1, node_phy) / counts.gather(1, node_phy)
    rank, slot_in_rank = balanced_packing(per_replica, ranks // nodes)
    local = rank * (node_slots // (ranks // nodes)) + slot_in_rank  # node-local physical slot of each replica
    phy_local = torch.empty_like(node_phy).scatter_(1, local, node_phy)
    phy_pos = (phy_local + (torch.arange(layers * nodes) % nodes * (experts // nodes)).unsqueeze(1))
    phy2log = order.gather(1, phy_pos.view(layers, num_physical))
    return _with_inverse(phy2log, experts, ranks)


def contiguous(layers: int, experts: int, ranks: int) -> Placement:
    """One replica per expert, in order: rank r holds experts [r E / ranks, (r+1) E / ranks) (plain expert
    parallelism)."""
    return _with_inverse(torch.arange(experts).expand(layers, experts).contiguous(), experts, ranks)


def _with_inverse(phy2log: torch.Tensor, experts: int, ranks: int) -> Placement:
    layers, slots = phy2log.shape
    replicas = torch.zeros(layers, experts, dtype=torch.long).scatter_add_(1, phy2log, torch.ones_like(phy2log))
    log2phy = torch.full((layers, experts, int(replicas.max())), -1, dtype=torch.long)
    seen = torch.zeros(layers, experts, dtype=torch.long)
    for layer in range(layers):
        for s in range(slots):
            e = int(phy2log[layer, s])
            log2phy[layer, e, seen[layer, e]] = s
            seen[layer, e] += 1
    return Placement(phy2log, log2phy, replicas, ranks)


def rank_loads(placement: Placement, loads: torch.Tensor) -> torch.Tensor:
    """Tokens per rank per layer [L, ranks] when each expert's `loads` [L, E] split evenly over its replicas."""
    per_slot = loads.double().gather(1, placement.phy2log) / placement.replicas.gather(1, placement.phy2log)
    return per_slot.view(per_slot.shape[0], placement.ranks, -1).sum(-1)


def balance(placement: Placement, loads: torch.Tensor) -> torch.Tensor:
    """max / mean tokens per rank, per layer [L] (1.0 is perfect)."""
    per_rank = rank_loads(placement, loads)
    return per_rank.max(dim=1).values / per_rank.mean(dim=1).clamp(min=1e-12)


def route(placement: Placement, layer: int, experts: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Physical slots for logical `experts` [N, k] of one layer: token t's replica of e is number t mod replicas(e)
    (deterministic: the same token goes to the same replica whatever the batch)."""
    count = placement.replicas[layer][experts]
    pick = tokens.view(-1, 1).long() % count
    return placement.log2phy[layer][experts, pick]


def remap_table(placement: Placement, layer: int, tid2eid: torch.Tensor) -> torch.Tensor:
    """A hash-routed layer's table [vocab, k] of logical experts as physical slots (`route` with the token id)."""
    return route(placement, layer, tid2eid.long(), torch.arange(tid2eid.shape[0])).to(tid2eid.dtype)
