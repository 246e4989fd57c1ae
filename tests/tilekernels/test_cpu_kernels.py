"""Every op with kernels, run through its wrapper on TileLang's `c` target in fp32, against its reference;
then the whole tiny model through the kernel op table against the reference op table."""

from __future__ import annotations

import re

import pytest
import torch

from codegen.driver import record_run
from tilekernels import reference_table
from tilekernels.errors import ShapeError
from tilekernels.kernels import Recorder, kernel_table, table
from tilekernels.ops import (DECLARED, act_quant, compress_pool, compress_ring, hc_mid, hc_post, hc_pre, indexer_scores,
                             indexer_topk, linear, moe_experts,
                             moe_gate, rms_norm, rope, sparse_attention, swiglu)


@pytest.fixture(scope="module")
def cache(c_kernel_cache, request):
    """The session's c kernel cache, with the kernels of this module's selected cases (and of TINY_A's plan when
    the tiny-model test runs) built ahead by two workers: each test then loads its kernels built."""
    from deepinfer.compile.plan import kernel_plan
    from deepinfer.config import ModelConfig
    from tests.helpers import TINY_A, kernels_of, prebuild_c, selected

    items = [item for case in selected(request, "case") for item in kernels_of(*CASES[case])]
    if any(item.name == "test_tiny_model_through_kernels_equals_reference_path" for item in request.session.items):
        items += kernel_plan(ModelConfig.from_dict(TINY_A), "float32")
    prebuild_c(c_kernel_cache, items)
    return c_kernel_cache


@pytest.fixture(scope="module")
def ops(cache):
    return kernel_table("c", cache)


def sorted_routes(weights, indices):
    order = weights.argsort(dim=-1)
    return weights.gather(1, order), indices.long().gather(1, order)


F = "float32"
# case -> (op, variant, rows): the inputs are the op's own `example(variant, rows, "cpu")`. "-odd" cases use
# widths no thread count divides (the GPU bodies pad and mask them), "-ragged" ones widths the target's
# chunks do not divide (the last chunk is partial: c target chunks are 64 wide, swiglu blocks 512).
CASES = {  # FP8 GEMM cases (linear with FP8 weights) are in test_fp8_kernels.py: they compare to an emulation
    "act_quant": ("act_quant", act_quant.Variant(256, 128, F), 7),
    "act_quant-ue8m0-ragged": ("act_quant", act_quant.Variant(100, 32, F, pow2=True), 5),
    "rms_norm": ("rms_norm", rms_norm.Variant(64, F), 5),
    "rms_norm-odd": ("rms_norm", rms_norm.Variant(20, F), 3),
    "rms_norm_unweighted": ("rms_norm_unweighted", rms_norm.Variant(32, F, weighted=False), 5),
    "rope": ("rope", rope.Variant(4, 32, 8, F), 6),
    "rope-inverse-odd": ("rope", rope.Variant(5, 20, 6, F, inverse=True), 3),
    "rope-norm": ("rope", rope.Variant(4, 32, 8, F, inplace=True, norm=True), 6),  # V4's q norm in the same pass
    "rope-norm-odd": ("rope", rope.Variant(6, 20, 6, F, inverse=True, inplace=True, norm=True), 3),
    "rope-kv": ("rope", rope.Variant(1, 32, 8, F), 6),
    "rope-inplace": ("rope", rope.Variant(4, 32, 8, F, inplace=True), 6),
    "rope-inplace-inverse-odd-kv": ("rope", rope.Variant(1, 20, 6, F, inverse=True, inplace=True), 3),
    "rope-inplace-grouped": ("rope", rope.Variant(4, 8, 2, F, inplace=True), 5),  # 2 heads per tile on the c target
    "linear": ("linear", linear.Variant(32, 48, F), 37),
    "linear-splitk": ("linear", linear.Variant(32, 1024, F), 3),
    "linear-ragged": ("linear", linear.Variant(40, 48, F), 3),  # N=40: the c target's 16-wide tiles do not divide it
    "grouped_linear": ("grouped_linear", linear.Variant(32, 48, F, groups=2), 7),
    "swiglu": ("swiglu", swiglu.Variant(64, F), 5),
    "swiglu-ragged": ("swiglu", swiglu.Variant(600, F), 3),
    "moe_gate": ("moe_gate", moe_gate.Variant(16, 3, "sqrtsoftplus", F), 9),
    "moe_gate-sigmoid-odd": ("moe_gate", moe_gate.Variant(6, 2, "sigmoid", F), 7),
    "moe_gate-hash": ("moe_gate", moe_gate.Variant(16, 3, "sqrtsoftplus", F, hashed=True), 9),
    "moe_experts": ("moe_experts", moe_experts.Variant(32, 48, 4, F), 10),
    "moe_experts-fp4": ("moe_experts", moe_experts.Variant(64, 64, 4, F, fp4=True), 10),
    "moe_experts-fp4-ragged": ("moe_experts", moe_experts.Variant(192, 96, 5, F, fp4=True), 33),
    "hc_pre": ("hc_pre", hc_pre.Variant(4, 64, 20, F), 5),
    "hc_pre-ragged": ("hc_pre", hc_pre.Variant(3, 40, 3, F), 3),
    "hc_pre-split-ragged": ("hc_pre", hc_pre.Variant(3, 520, 3, F), 2),  # split K: 4 parts, the last masked
    "hc_pre-v4-flash": ("hc_pre", hc_pre.Variant(4, 4096, 3, F), 2),  # V4-Flash's width: 32 parts of 512 columns
    "hc_pre-norm": ("hc_pre", hc_pre.Variant(4, 64, 20, F, norm=True), 3),  # the collapse RMS-normalized
    "hc_pre-norm-ragged": ("hc_pre", hc_pre.Variant(2, 100, 3, F, norm=True), 2),  # chunks of 64: the last partial
    "hc_post": ("hc_post", hc_post.Variant(4, 64, F), 5),
    "hc_post-ragged": ("hc_post", hc_post.Variant(4, 100, F), 1),
    "hc_mid": ("hc_mid", hc_mid.Variant(4, 64, F, 64), 5),  # fused: one part of the whole width
    "hc_mid-parts": ("hc_mid", hc_mid.Variant(4, 384, F, 128), 3),  # fused: 3 parts of 128 columns
    "hc_mid-unfused": ("hc_mid", hc_mid.Variant(2, 48, F, 0), 3),  # no fused form: hc_post, then hc_pre
    "sparse_attention": ("sparse_attention", sparse_attention.Variant(16, 32, F), 3),
    "sparse_attention-odd": ("sparse_attention", sparse_attention.Variant(5, 20, F), 2),
    # enough queries for a plan of one split: the `whole` kernel (the sink merged in the kernel, no combine)
    "sparse_attention-whole": ("sparse_attention", sparse_attention.Variant(16, 32, F), 300),
    "indexer_scores": ("indexer_scores", indexer_scores.Variant(16, 64, F, False), 3),
    "indexer_scores-shared-odd": ("indexer_scores", indexer_scores.Variant(5, 20, F, True), 7),
    # 164 entries: three of the c target's 64-entry tiles; ties at the boundary, rows seeing all, k / 2, k + 1
    "indexer_topk": ("indexer_topk", indexer_topk.Variant(16), 7),
    # V4-Flash's compressors (CSA with its overlap: 8 slots, head_dim 512 and the indexer's 128; HCA: 128 slots),
    # V4.1's ratio 2, and channel counts the c target's 64-wide blocks do not divide (100: a partial block, 20)
    "compress_pool-csa": ("compress_pool", compress_pool.Variant(8, 512, F), 5),
    "compress_pool-csa-indexer": ("compress_pool", compress_pool.Variant(8, 128, F), 4),
    "compress_pool-hca": ("compress_pool", compress_pool.Variant(128, 512, F), 3),
    "compress_pool-v41": ("compress_pool", compress_pool.Variant(2, 512, F), 6),
    "compress_pool-ragged": ("compress_pool", compress_pool.Variant(8, 100, F), 3),
    "compress_pool-odd": ("compress_pool", compress_pool.Variant(3, 20, F), 4),
    # the same pooling read from the rings at decode (rate, slots, ring rows, width): CSA with its overlap, its
    # indexer, HCA, and widths no 64-channel block divides
    "compress_ring-csa": ("compress_ring", compress_ring.Variant(4, 8, 12, 1024, F), 5),
    "compress_ring-csa-indexer": ("compress_ring", compress_ring.Variant(4, 8, 12, 256, F), 3),
    "compress_ring-hca": ("compress_ring", compress_ring.Variant(128, 128, 130, 512, F), 2),
    "compress_ring-ragged": ("compress_ring", compress_ring.Variant(4, 8, 12, 200, F), 3),
    "compress_ring-odd": ("compress_ring", compress_ring.Variant(3, 3, 5, 20, F), 4),
}


def test_every_kernel_op_is_covered():
    from tests.tilekernels.test_v41_kernels import CASES as V41_CASES  # V4.1's own ops

    with_kernels = {name for name, op in DECLARED.items() if op.run is not None}
    assert with_kernels == {op for op, _, _ in CASES.values()} | {op for op, _, _ in V41_CASES.values()}


@pytest.mark.parametrize("case", sorted(CASES))
def test_op_matches_reference_in_fp32(case, ops, cache):
    name, variant, rows = CASES[case]
    torch.manual_seed(rows)
    args = DECLARED[name].example(variant, rows, "cpu")
    want = DECLARED[name].reference(*args)  # first: an in-place kernel form may overwrite its input
    got = getattr(ops, name)(*args)
    if name == "moe_gate":
        got, want = sorted_routes(*got), sorted_routes(*want)
    got, want = (got,) if isinstance(got, torch.Tensor) else got, (want,) if isinstance(want, torch.Tensor) else want
    atol, rtol = DECLARED[name].tolerance["float32"]
    for g, w in zip(got, want):
        assert g.shape == w.shape
        if g.dtype in (torch.int32, torch.int64):
            assert torch.equal(g.long(), w.long())
        else:
            torch.testing.assert_close(g.float(), w.float(), atol=atol, rtol=rtol)
    record_run(cache, name, "c", "fp32 on TileLang's c target matched the reference")


@pytest.mark.parametrize("k", [3, 16])
def test_indexer_topk_edges_as_the_reference(k, ops):
    """The radix select's edge cases: every visible score equal (ties only: the lowest entries), -0.0 beside
    +0.0 (equal, as the sort holds them), -inf scores, one pick among many equal ones, rows seeing nothing, fewer
    entries than k, k smaller than the kernel's slots; the picks and their order are the reference's."""
    e = 200
    s = torch.zeros(8, e)
    s[1, ::2] = -0.0
    s[2] = float("-inf")
    s[2, 50] = 1.0
    s[3] = torch.arange(e, dtype=torch.float32) % 3
    s[4] = -torch.arange(e, dtype=torch.float32)  # distinct, negative
    s[5, 7] = 2.0  # one clear maximum among equal keys
    s[6] = torch.randn(e).abs() * 1e-30  # tiny keys: the top differing bit is low
    s[7] = torch.randn(e) * 1e30
    vis = torch.tensor([e, 150, 100, 30, e, 0, e, 2])
    assert torch.equal(ops.indexer_topk(s, vis, k), indexer_topk.reference(s, vis, k))
    few = torch.randn(3, 2)  # fewer entries than k: every entry a pick, min(k, E) columns
    vis = torch.tensor([2, 1, 0], dtype=torch.int32)
    assert torch.equal(ops.indexer_topk(few, vis, k), indexer_topk.reference(few, vis, k))


def test_indexer_topk_names_bad_inputs(ops):
    with pytest.raises(ShapeError, match="scores must be fp32"):
        ops.indexer_topk(torch.zeros(2, 8, dtype=torch.float64), torch.zeros(2, dtype=torch.long), 4)
    with pytest.raises(ShapeError, match=r"visible must be integer \[2\]"):
        ops.indexer_topk(torch.zeros(2, 8), torch.zeros(3, dtype=torch.long), 4)
    with pytest.raises(ShapeError, match="k must be at least 1, got 0"):
        ops.indexer_topk(torch.zeros(2, 8), torch.zeros(2, dtype=torch.long), 0)


def test_rope_inplace_returns_its_input_rotated(ops):
    """The in-place form writes the rotated channels into x and returns x (the leading channels untouched); a
    strided x takes the copying form and is left as it was."""
    x, pos, inv, factor, inverse, _ = rope.example(rope.Variant(3, 32, 8, F, inplace=True), 5, "cpu")
    before, want = x.clone(), rope.reference(x, pos, inv, factor, inverse)
    got = ops.rope(x, pos, inv, factor, inverse, inplace=True)
    assert got is x and torch.equal(x[..., :24], before[..., :24])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    strided = before.transpose(0, 1).contiguous().transpose(0, 1)
    out = ops.rope(strided, pos, inv, factor, inverse, inplace=True)
    assert out is not strided and torch.equal(strided, before)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_compress_pool_empty_slots_and_windows_as_the_reference(ops):
    """Empty (-inf) slots weigh 0; a channel whose every slot is empty, and a whole empty window, give the
    reference's NaN (no caller builds one: compress_pool.py); no window (a short prefill chunk) launches nothing."""
    kv, gate = compress_pool.example(compress_pool.Variant(8, 100, F), 4, "cpu")
    gate[0, :4] = float("-inf")  # CSA's first window: no predecessor
    gate[1, :, 7] = float("-inf")
    gate[2] = float("-inf")
    got, want = ops.compress_pool(kv, gate), compress_pool.reference(kv, gate)
    assert torch.equal(got.isnan(), want.isnan()) and int(want.isnan().sum()) == 101
    torch.testing.assert_close(got, want, atol=3.5e-5, rtol=1e-6, equal_nan=True)
    assert ops.compress_pool(kv[:0], gate[:0]).shape == (0, 100)


@pytest.mark.parametrize("kv, gate, message", [
    ((3, 8, 64), (3, 8), "gate must be kv's shape [3, 8, 64], got [3, 8]"),
    ((24, 64), (24, 64), "kv must be [W, S, d], got [24, 64]"),
    ((3, 300, 64), (3, 300, 64), "slots per window S=300; accepted: 1..256"),
    ((3, 0, 64), (3, 0, 64), "slots per window S=0; accepted: 1..256"),
])
def test_compress_pool_names_the_shapes_it_cannot_take(kv, gate, message, ops):
    with pytest.raises(ShapeError, match=re.escape(message)):
        ops.compress_pool(torch.zeros(kv), torch.zeros(gate))
    with pytest.raises(ShapeError, match="kv dtype torch.int32 is not one of"):
        ops.compress_pool(torch.zeros(3, 8, 64, dtype=torch.int32), torch.zeros(3, 8, 64))


def test_compress_pool_variant_from_meta_tensors():
    """The plan traces on meta tensors: bf16 kv with fp32 gates (V4 on the GPU) is its own variant; W is dynamic."""
    recorder = Recorder()
    for w in (1, 4096):
        kv = torch.empty(w, 128, 512, dtype=torch.bfloat16, device="meta")
        table(recorder).compress_pool(kv, torch.empty(w, 128, 512, device="meta"))
    assert list(recorder.seen) == [("compress_pool", "compress_pool",
                                    compress_pool.Variant(128, 512, "bfloat16", "float32"))]


def test_tiny_model_through_kernels_equals_reference_path(cache):
    from deepinfer.config import ModelConfig
    from deepinfer.model.weights import ModelWeights
    from tests.helpers import TINY_A, Runner, canonical_state, hf_model

    cfg = ModelConfig.from_dict(TINY_A)
    weights = ModelWeights.from_tensors(cfg, canonical_state(hf_model(TINY_A)))
    ids = torch.randint(0, cfg.vocab_size, (150,))

    def logits(table):
        run = Runner(cfg, weights, table, tokens=256, seqs=2)
        a, b = run.new_seq(), run.new_seq()
        out = [run.prefill(a, ids[:140]), run.prefill(b, ids[:23])]
        for i in range(140, 150):  # decode steps, both sequences in one batch
            out.append(run.decode([a, b], [int(ids[i]), int(ids[i - 117])]))
        return torch.cat(out)

    assert (logits(kernel_table("c", cache)) - logits(reference_table())).abs().max().item() <= 1e-4
