"""The compressors' two decode paths give the same logits: `compress_ring` (windows of up to GATHER_SLOTS slots) and
the PyTorch gather + `compress_pool` (longer windows), each forced for every compressor of the tiny model (CSA with
its overlap, its indexer, HCA) over steps that cross window boundaries, the first window included."""

import pytest
import torch

from deepinfer.model.model import DeepseekV4
from deepinfer.model.weights import ModelWeights
from deepinfer.runtime.cache import CacheSpec, PagedCache
from deepinfer.runtime.graph import DecodeGraphs
from deepinfer.tiny import random_tensors, tiny_config
from tilekernels import reference_table
from tilekernels.op import OpTable
from tilekernels.ops import DECLARED, compress_ring


def counted(calls: dict) -> OpTable:
    """The reference op table, counting the pooling ops' calls into `calls`."""
    table = reference_table()

    def wrap(name):
        def op(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return getattr(table, name)(*args, **kwargs)
        return op

    return OpTable({n: wrap(n) if n.startswith("compress_") else getattr(table, n) for n in table.names()}, DECLARED)


def decode_logits(model, cfg, steps: int) -> list[torch.Tensor]:
    cache = PagedCache(cfg, CacheSpec(num_blocks=8, max_seqs=2, max_blocks_per_seq=4), torch.float32, "cpu")
    seqs = [cache.admit(), cache.admit()]
    for s in seqs:
        assert cache.grow(s, steps + 3)
    graphs, out = DecodeGraphs(model, cache, 2, None), []
    with torch.inference_mode():
        for t in range(steps):  # the two sequences at different positions: the second 3 tokens ahead
            out.append(graphs.run([5 + t, 9 + t], [t, t + 3], seqs))
    return out


@pytest.mark.parametrize("slots, ring_calls", [(0, 0), (1 << 10, 5 * 10)])
def test_both_paths_give_the_same_logits(slots, ring_calls, monkeypatch):
    """The tiny model: CSA, HCA, CSA layers after a sliding one (5 compressors); by default CSA's windows of 8 slots
    take the ring kernel, HCA's 128 the gather."""
    cfg = tiny_config()
    calls: dict = {}
    model = DeepseekV4(cfg, ModelWeights.from_tensors(cfg, random_tensors(cfg, seed=4)), counted(calls))
    want = decode_logits(model, cfg, 10)
    assert calls == {"compress_ring": 4 * 10, "compress_pool": 1 * 10}
    calls.clear()
    monkeypatch.setattr(compress_ring, "GATHER_SLOTS", slots)
    got = decode_logits(model, cfg, 10)
    assert calls.get("compress_ring", 0) == ring_calls and calls.get("compress_pool", 0) == 5 * 10 - ring_calls
    for step, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), f"step {step}"
