"""The cache layout: one frozen object sizes the cache's tensors and gives every row index the model uses."""

from __future__ import annotations

import pytest
import torch

from deepinfer.config import CSA, ModelConfig
from deepinfer.runtime.cache import CacheLayout, CacheSpec, PagedCache
from tests.helpers import ODD_A, ODD_B, TINY_A, TINY_B

CONFIGS = {"tiny_a": TINY_A, "tiny_b": TINY_B, "odd_a": ODD_A, "odd_b": ODD_B}
SPECS = [CacheSpec(num_blocks=7, max_seqs=3, max_blocks_per_seq=4),
         CacheSpec(num_blocks=2, max_seqs=1, max_blocks_per_seq=2, block_tokens=256)]


def old_block_bytes(cfg: ModelConfig, block_tokens: int, dtype: torch.dtype) -> tuple[int, int]:
    """A separate size computation (a cross-check of the layout's): per slot, the window ring and each compressor's
    kv and gate buffer rings (the open window, and for CSA and its indexer the last closed window too)."""
    elt = torch.tensor([], dtype=dtype).element_size()
    d, di, w = cfg.head_dim, cfg.index_head_dim, cfg.sliding_window
    per_block = per_slot = 0
    for i, kind in enumerate(cfg.layer_types):
        rate = cfg.compress_rate(i)
        per_slot += w * d * elt
        if rate:
            width = 2 * d if kind == CSA else d
            per_block += block_tokens // rate * d * elt
            per_slot += 2 * (2 if kind == CSA else 1) * rate * width * elt
        if kind == CSA:
            per_block += block_tokens // rate * di * elt
            per_slot += 2 * 2 * rate * 2 * di * elt
    return per_block, per_slot


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layout_bytes_equal_the_allocated_bytes(name, spec, dtype):
    cfg = ModelConfig.from_dict(CONFIGS[name])
    cache = PagedCache(cfg, spec, dtype, "meta")
    layout = cache.layout
    assert layout.nbytes == cache.num_bytes()
    assert layout.nbytes == (spec.max_seqs + 1) * layout.slot_bytes + (spec.num_blocks + 1) * layout.block_bytes
    assert (layout.block_bytes, layout.slot_bytes) == old_block_bytes(cfg, spec.block_tokens, dtype)
    for lay, layer in zip(layout.layers, cache.layers):
        assert [r.nbytes for r in lay.regions] == [t.numel() * t.element_size() for t in layer.tensors()]
        assert [r.dtype for r in lay.regions] == [t.dtype for t in layer.tensors()]
        assert tuple(layer.pool.shape) == lay.pool.shape
    # A layout is a value: the same inputs give an equal (and hashable) object.
    assert CacheLayout.build(cfg, spec, dtype) == layout
    hash(layout)


@pytest.mark.parametrize("name", CONFIGS)
def test_row_methods_give_the_old_rows(name):
    cfg = ModelConfig.from_dict(CONFIGS[name])
    spec = CacheSpec(num_blocks=9, max_seqs=3, max_blocks_per_seq=3)
    cache = PagedCache(cfg, spec, torch.float32, "cpu")
    gen = torch.Generator().manual_seed(0)
    b, window = 5, cfg.sliding_window
    slots = torch.randint(0, spec.max_seqs + 1, (b,), generator=gen)
    pos = torch.randint(0, spec.max_tokens, (b,), generator=gen)
    pos[0] = 0
    blocks = torch.randint(0, spec.num_blocks + 1, (b, spec.max_blocks_per_seq), generator=gen)
    for layer in cache.layers:
        lay = layer.layout
        ring = layer.ring
        assert ring.data_ptr() == layer.pool.data_ptr() and ring.shape == (spec.max_seqs + 1, window, cfg.head_dim)
        # window rows: the ring view's [slot, pos % W] is the pool's window_rows(slot, pos)
        assert torch.equal(lay.window_rows(slots, pos), slots * window + pos % window)
        flat = torch.arange(ring.numel() // cfg.head_dim).view(ring.shape[:2])
        assert torch.equal(flat[slots, pos % window], lay.window_rows(slots, pos))
        for comp in (layer.compressor, layer.indexer):
            if comp is None:
                continue
            cl, per_block = comp.layout, spec.block_tokens // comp.rate
            assert cl.per_block == per_block
            base = (spec.max_seqs + 1) * window if comp is layer.compressor else 0  # the indexer has its own store
            assert cl.base == base and (comp is not layer.compressor or lay.entry_base == base)

            def old_rows(bl, entries):
                return base + bl.gather(-1, entries // per_block) * per_block + entries % per_block

            entry = torch.arange(blocks.shape[1] * per_block).view(1, -1).expand(b, -1)
            assert torch.equal(cl.entry_rows(blocks, entry), old_rows(blocks, entry))
            assert torch.equal(cl.closed(pos), (pos + 1) // comp.rate)
            assert cl.buffer_rows == (2 if cl.overlap else 1) * cl.rate
            rings = comp.buf_kv.clone()  # the flat row is the ring place [slot, position % buffer_rows]
            rings.view(-1, rings.shape[-1])[cl.buffer_row(slots, pos)] = 1.0
            expect = comp.buf_kv.clone()
            expect[slots, pos % cl.buffer_rows] = 1.0
            assert torch.equal(rings, expect)
            # entry rows hit the places the old per-block entries view [blocks + 1, per_block, d] indexed
            probe = comp.store.clone()
            probe[cl.entry_rows(blocks, entry)] = 1.0
            expect = comp.store.clone()
            expect[base:].view(spec.num_blocks + 1, per_block, -1)[blocks.repeat_interleave(per_block, dim=1),
                                                                 entry % per_block] = 1.0
            assert torch.equal(probe, expect)


def _meta_weights(cfg: ModelConfig, dtype: torch.dtype):
    from deepinfer.model.weights import FP32, INT, ModelWeights, tensor_specs

    kinds = {FP32: torch.float32, INT: torch.long}
    tensors = {name: torch.empty(spec.shape, dtype=kinds.get(spec.kind, dtype), device="meta")
               for name, spec in tensor_specs(cfg).items()}
    return ModelWeights.from_tensors(cfg, tensors)


def _meta_table():
    """The reference op table, except that `moe_experts`, whose reference reads expert counts on the host
    (bincount(...).tolist(), no meta kernel), gives a shape-only result on meta tensors."""
    from tilekernels import OpTable
    from tilekernels.ops import DECLARED

    impls = {name: decl.reference for name, decl in DECLARED.items()}
    ref = impls["moe_experts"]
    impls["moe_experts"] = lambda x, *a, **k: torch.empty_like(x) if x.is_meta else ref(x, *a, **k)
    return OpTable(impls, DECLARED)


@pytest.mark.parametrize("name", ["tiny_a", "tiny_b", "odd_b"])
def test_prefill_and_decode_run_on_meta_tensors(name):
    from deepinfer.model.decode import DecodeInputs
    from deepinfer.model.model import DeepseekV4
    from deepinfer.runtime.graph import DecodeGraphs

    cfg = ModelConfig.from_dict(CONFIGS[name])
    dtype = torch.bfloat16
    model = DeepseekV4(cfg, _meta_weights(cfg, dtype), _meta_table())
    assert model.device.type == "meta"
    spec = CacheSpec(num_blocks=8, max_seqs=2, max_blocks_per_seq=4)
    cache = PagedCache(cfg, spec, dtype, "meta")
    assert all(t.is_meta for t in cache.tensors())
    seqs = [cache.admit(), cache.admit()]
    lengths = [130, 37]  # past a block boundary and several windows
    for s, n in zip(seqs, lengths):
        assert cache.grow(s, n + 1)
    n = sum(lengths)
    ids = torch.empty(n, dtype=torch.long, device="meta")
    positions = torch.empty(n, dtype=torch.long, device="meta")
    logits = model.prefill(cache, ids, positions, [(seqs[0], 0, lengths[0]), (seqs[1], lengths[0], lengths[1])])
    assert logits.is_meta and logits.shape == (n, cfg.vocab_size)
    assert [s.num_tokens for s in seqs] == lengths
    # a second chunk continues a sequence
    logits = model.prefill(cache, ids[:5], positions[:5], [(seqs[1], 0, 5)])
    assert logits.shape == (5, cfg.vocab_size) and seqs[1].num_tokens == lengths[1] + 5

    b = 4  # padded: two real rows, two scratch rows
    inp = DecodeInputs(
        ids=torch.empty(b, dtype=torch.long, device="meta"),
        positions=torch.empty(b, dtype=torch.long, device="meta"),
        slots=torch.empty(b, dtype=torch.long, device="meta"),
        blocks=cache.block_table(seqs, rows=b),
    )
    logits = model.decode(cache, inp)
    assert logits.is_meta and logits.shape == (b, cfg.vocab_size) and logits.dtype == torch.float32
    # and through the graph runner's static buffers (eager here)
    graphs = DecodeGraphs(model, cache, 4, None)
    out = graphs.run([1, 2], [s.num_tokens for s in seqs], seqs)
    assert out.is_meta and out.shape == (2, cfg.vocab_size)
