"""EPLB placement (deepinfer/parallel/eplb.py): a hand-checked example, the balance it reaches on skewed loads,
the maps' invariants, routing and the hash table's remap, and the errors for shapes that do not divide."""

import pytest
import torch

from deepinfer.errors import ConfigError
from deepinfer.parallel import eplb


def zipf_loads(layers: int, experts: int, seed: int = 0, skew: float = 1.0) -> torch.Tensor:
    """Tokens per expert per layer: a Zipf law over a random expert order per layer (the hottest expert of 256
    takes ~16 % of a layer's tokens at skew 1)."""
    g = torch.Generator().manual_seed(seed)
    base = 1e5 / torch.arange(1, experts + 1).double() ** skew
    return torch.stack([base[torch.randperm(experts, generator=g)] for _ in range(layers)])


def test_a_hand_checked_placement():
    # 4 experts, loads 8/4/2/2, 6 slots on 2 ranks. Replicas: expert 0 takes both spare slots (8/1 > 4, then
    # 8/2 = 4 ties expert 1's 4: the lower index). Replica loads 8/3, 4, 2, 2, 8/3, 8/3 packed heaviest first into
    # the lighter rank with room: rank 0 gets slots 1, 5, 3 (experts 1, 0, 3: 4 + 8/3 + 2), rank 1 slots 0, 4, 2
    # (experts 0, 0, 2: 8/3 + 8/3 + 2).
    loads = torch.tensor([[8.0, 4.0, 2.0, 2.0]])
    p = eplb.place(loads, num_physical=6, ranks=2)
    assert p.phy2log.tolist() == [[1, 0, 3, 0, 0, 2]]
    assert p.replicas.tolist() == [[3, 1, 1, 1]]
    assert p.log2phy.tolist() == [[[1, 3, 4], [0, -1, -1], [5, -1, -1], [2, -1, -1]]]
    assert eplb.rank_loads(p, loads)[0].tolist() == pytest.approx([4 + 8 / 3 + 2, 16 / 3 + 2])
    assert eplb.balance(p, loads).item() == pytest.approx((26 / 3) / 8)


@pytest.mark.parametrize("ranks, nodes, groups", [(8, 1, 1), (8, 1, 8), (8, 2, 8), (16, 2, 8), (4, 1, 8)])
def test_skewed_loads_balance_within_ten_percent(ranks, nodes, groups):
    loads = zipf_loads(layers=4, experts=256)
    naive = loads.view(4, ranks, -1).sum(-1)  # the experts in order, 256 / ranks per rank, no replicas
    assert (naive.max(1).values / naive.mean(1)).min() > 1.25  # the load is skewed
    p = eplb.place(loads, num_physical=288, ranks=ranks, groups=groups, nodes=nodes)  # 32 redundant experts
    assert eplb.balance(p, loads).max() <= 1.10


def test_without_redundant_experts_the_hottest_expert_bounds_the_balance():
    loads = zipf_loads(layers=2, experts=256)
    p = eplb.place(loads, num_physical=256, ranks=8)
    assert (p.replicas == 1).all()
    bound = loads.max(1).values / (loads.sum(1) / 8)  # one rank holds the hottest expert whole
    assert (eplb.balance(p, loads) >= bound - 1e-9).all()


def test_the_maps_are_consistent():
    loads = zipf_loads(layers=3, experts=64, seed=3)
    p = eplb.place(loads, num_physical=80, ranks=8, groups=4, nodes=2)
    assert p.phy2log.shape == (3, 80) and p.slots_per_rank == 10
    assert (p.replicas >= 1).all() and (p.replicas.sum(1) == 80).all()
    for layer in range(3):
        for e in range(64):
            slots = [s for s in p.log2phy[layer, e].tolist() if s >= 0]
            assert len(slots) == p.replicas[layer, e] and all(p.phy2log[layer, s] == e for s in slots)
    # hierarchical: a group's experts all live on one node (ranks 0-3 or 4-7)
    for layer in range(3):
        node_of = p.phy2log[layer].view(2, 40)
        for g in range(4):
            members = set(range(g * 16, g * 16 + 16))
            nodes = {n for n in range(2) if members & set(node_of[n].tolist())}
            assert len(nodes) == 1


def test_routing_and_the_hash_table_remap():
    loads = torch.tensor([[100.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    p = eplb.place(loads, num_physical=12, ranks=4)
    assert p.replicas[0, 0] == 5
    experts = torch.tensor([[0, 3], [0, 1], [0, 2]])
    slots = eplb.route(p, 0, experts, torch.tensor([7, 8, 9]))
    assert (p.phy2log[0][slots] == experts).all()
    assert len(set(slots[:, 0].tolist())) == 3  # the hot expert's tokens spread over its replicas
    assert torch.equal(eplb.route(p, 0, experts[:1], torch.tensor([7])), slots[:1])  # per token, not per batch
    tid2eid = torch.tensor([[0, 1], [2, 0], [0, 3]], dtype=torch.int32)
    table = eplb.remap_table(p, 0, tid2eid)
    assert table.dtype == torch.int32 and (p.phy2log[0][table.long()] == tid2eid).all()


@pytest.mark.parametrize("physical, ranks, nodes, groups, message", [
    (70, 8, 1, 1, "divide over the ranks"),
    (64, 8, 3, 1, "divide over the ranks"),
    (64, 8, 1, 3, "experts over the groups"),
    (48, 8, 1, 1, "cannot hold 64 experts"),
    (64, 0, 1, 1, "ranks must be at least 1"),
])
def test_shapes_that_do_not_divide_are_named(physical, ranks, nodes, groups, message):
    with pytest.raises(ConfigError, match=message):
        eplb.place(zipf_loads(1, 64), physical, ranks, groups=groups, nodes=nodes)
