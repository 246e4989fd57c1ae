"""The attention block's input projections stacked at load (`deepinfer.model.stacked`): which parts join, that the
block's fields are views of the stack (no weight held twice), and that one GEMM over the stack gives each part's
own product."""

import pytest
import torch

from deepinfer.config import CSA, HCA, SLIDING
from deepinfer.model.stacked import project_all, stack
from deepinfer.model.weights import ModelWeights
from deepinfer.tiny import random_tensors, tiny_config
from tilekernels import reference_table
from tilekernels.quant import BlockQuantized, dense, quantize


def _shares(view: torch.Tensor, base: torch.Tensor) -> bool:
    return view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()


def test_plain_parts_stack_into_one_weight_whose_rows_are_the_parts():
    g = torch.Generator().manual_seed(0)
    parts = [(n, torch.randn(r, 64, generator=g)) for n, r in (("q_a", 48), ("kv", 32), ("comp_kv", 16))]
    stacks, views = stack(parts)
    assert len(stacks) == 1 and stacks[0].names == ("q_a", "kv", "comp_kv") and stacks[0].sizes == (48, 32, 16)
    for name, w in parts:
        assert torch.equal(views[name], w) and _shares(views[name], stacks[0].weight) and views[name].is_contiguous()
    x = torch.randn(5, 64, generator=g)
    out = project_all(reference_table(), x, stacks)
    for name, w in parts:
        torch.testing.assert_close(out[name], x @ w.T, rtol=1e-5, atol=1e-5)


def test_storage_decides_the_stacks():
    """FP8 parts with one block join each other, plain ones each other; a part of another dtype or K stays alone."""
    g = torch.Generator().manual_seed(1)
    fp8 = lambda r: quantize(torch.randn(r, 256, generator=g), "fp8", (128, 128))  # noqa: E731
    parts = [("q_a", fp8(256)), ("kv", fp8(128)), ("comp_kv", torch.randn(64, 256, generator=g)),
             ("comp_gate", torch.randn(64, 256, generator=g)), ("index_kv", torch.randn(8, 256, generator=g).double()),
             ("index_gate", torch.randn(8, 128, generator=g))]
    stacks, views = stack(parts)
    assert [s.names for s in stacks] == [("q_a", "kv"), ("comp_kv", "comp_gate")]
    q8 = stacks[0].weight
    assert isinstance(q8, BlockQuantized) and q8.shape == (384, 256) and q8.scales.shape == (3, 2)
    for name, w in parts:
        assert torch.equal(dense(views[name], torch.float64), dense(w, torch.float64)), name
    assert views["index_kv"] is parts[4][1] and views["index_gate"] is parts[5][1]


def test_a_block_quantized_part_off_the_block_grid_ends_its_stack():
    """64 rows of a 128-row block: the scale grid could not carry a part after it, so the next starts a new stack."""
    g = torch.Generator().manual_seed(2)
    parts = [(n, quantize(torch.randn(r, 128, generator=g), "fp8", (128, 128))) for n, r in (("a", 64), ("b", 128), ("c", 64))]
    stacks, views = stack(parts)
    assert [s.names for s in stacks] == [("b", "c")]
    assert views["a"] is parts[0][1]
    assert stacks[0].weight.scales.shape == (2, 1)
    for name, w in parts:
        assert torch.equal(dense(views[name], torch.float32), dense(w, torch.float32)), name


@pytest.mark.parametrize("layer", [0, 1, 2])
def test_model_blocks_hold_their_projections_once(layer):
    cfg = tiny_config()
    tensors = random_tensors(cfg, seed=3)
    w = ModelWeights.from_tensors(cfg, tensors).layers[layer].attn
    names = {SLIDING: ("q_a", "kv"), CSA: ("q_a", "kv", "comp_kv", "comp_gate", "index_kv", "index_gate",
                                          "index_weights"), HCA: ("q_a", "kv", "comp_kv", "comp_gate")}
    kind = cfg.layer_types[layer]
    assert len(w.inputs) == 1 and w.inputs[0].names == names[kind]
    a = f"layers.{layer}.self_attn."
    assert torch.equal(w.q_a_proj, tensors[a + "q_a_proj.weight"]) and _shares(w.q_a_proj, w.inputs[0].weight)
    assert torch.equal(w.kv_proj, tensors[a + "kv_proj.weight"]) and _shares(w.kv_proj, w.inputs[0].weight)
    if w.indexer is not None:
        assert _shares(w.indexer.weights_proj, w.inputs[0].weight)
