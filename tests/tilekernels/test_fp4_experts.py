"""The FP4 routed experts at decode sizes (moe_experts + moe_fp4): the decoders' bit tricks against the e2m1
table, the expert-major layout's tile bound, which variant and body `run` picks, the c-target numerics of the
portable body at the decode tile, and the sm_90a override built to a cubin at V4-Flash widths (lowering for
sm100/Ascend of the portable body at the decode tile), and the sm_100a block-scaled override lowered (never run:
no Blackwell GPU here). The sm_90a override runs only on the H200 (tests/gpu, benchmarks/fp4_experts.py)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

import backends
from codegen import Compiler
from tilekernels.kernels import Recorder, request
from tilekernels.ops import DECLARED, moe_experts, moe_fp4
from tilekernels.quant import FP4_E2M1_VALUES, quantize

LUT = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float64)
BYTES = torch.arange(256, dtype=torch.int64)
EXPS = torch.arange(3, 241, dtype=torch.int64)  # exponents whose e2m1 * 2^(e-127) are normal bf16 numbers


def want(b: torch.Tensor, e: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The low and high codes' values of bytes b in blocks of exponent e (float64, broadcast [B, E])."""
    scale = torch.pow(2.0, (e - 127).double())[None, :]
    return LUT[b & 15][:, None] * scale, LUT[b >> 4][:, None] * scale


def bf16_bits_to_float(bits: torch.Tensor) -> torch.Tensor:
    return (bits.to(torch.int32) << 16).view(torch.float32).double()  # subnormals kept (CPU: no flush)


def test_pair_decoder_bits_are_e2m1_times_two_to_the_exponent():
    v = ((BYTES * 0x00040040) & 0x01C001C0) | ((BYTES * 0x01001000) & 0x80008000)
    lo, hi = bf16_bits_to_float(v & 0xFFFF), bf16_bits_to_float(v >> 16)
    for half, ref in zip((lo, hi), want(BYTES, EXPS)):
        got = half[:, None] * 2.0**126 * torch.pow(2.0, (EXPS - 127).double())[None, :]  # the two bf16x2 products
        assert torch.equal(got, ref)
        assert torch.equal(got.to(torch.bfloat16).double(), got)  # exact in bf16: the rounding is a no-op


def test_half_decoder_bits_are_e2m1_times_two_to_the_exponent():
    for shift, ref in zip((0, 4), want(BYTES, EXPS)):
        code = BYTES >> shift
        bits = ((code & 8) << 12) | ((code & 7) << 9)
        half = bits.to(torch.int16).view(torch.float16).double()  # e2m1 * 2^-14, the 0.5 a subnormal
        scale = ((EXPS + 14) << 23).to(torch.int32).view(torch.float32).double()  # 2^(e-113)
        got = half[:, None] * scale[None, :]
        assert torch.equal(got, ref) and torch.equal(got.to(torch.bfloat16).double(), got)


@pytest.mark.parametrize("tokens, top_k, experts, bm", [(1, 6, 256, 16), (1, 6, 256, 64), (8, 6, 256, 16),
                                                        (64, 6, 256, 16), (33, 2, 5, 16), (70, 3, 4, 64)])
def test_layout_places_every_row_within_the_tile_bound(tokens, top_k, experts, bm):
    torch.manual_seed(tokens)
    for skew in (False, True):
        scores = torch.rand(tokens, experts)
        if skew:  # everyone routes to the same few experts: experts get several tiles
            scores[:, :top_k] += 1
        idx = scores.topk(top_k, dim=-1).indices
        dest, tiles = moe_experts.layout(idx, experts, bm)
        assert dest.unique().numel() == dest.numel() and int(dest.max()) < tiles.numel() * bm
        flat = idx.reshape(-1)
        assert torch.equal(tiles[(dest // bm)].long(), flat)  # every row sits in a tile of its expert
        counts = torch.bincount(flat, minlength=experts)
        assert int((tiles >= 0).sum()) == int(((counts + bm - 1) // bm).sum())  # valid tiles first, then -1
        assert bool((tiles[: int((tiles >= 0).sum())] >= 0).all())
    if tokens == 1:
        assert tiles.numel() == top_k  # one token: one tile per routed expert, nothing launched for the rest


def launched(tokens: int) -> list:
    rec = Recorder()
    args = moe_experts.example(moe_experts.Variant(64, 32, 16, "bfloat16", fp4=True), tokens, "cpu")
    args = tuple(a.to("meta") if isinstance(a, torch.Tensor) else a for a in args)  # no-op kernels: nothing to read
    moe_experts.run(rec.for_op("moe_experts"), *args)
    return [variant for (_, kernel, variant) in rec.seen if kernel == "grouped_gemm_fp4"]


def test_run_picks_the_decode_tile_up_to_64_tokens():
    assert {v.block_m for v in launched(1)} == {moe_experts.DECODE_BLOCK_M}
    assert {v.block_m for v in launched(moe_experts.DECODE_TOKENS)} == {moe_experts.DECODE_BLOCK_M}
    assert {v.block_m for v in launched(moe_experts.DECODE_TOKENS + 1)} == {moe_experts.BLOCK_M}
    assert moe_experts.DECODE_TOKENS + 1 in DECLARED["moe_experts"].row_samples


def test_the_fp4_overrides_take_the_variants_they_are_for():
    """sm90 runs `moe_fp4`'s swapped-operand kernel for its bf16 variants, decode (16-row tiles) and prefill
    (64-row tiles, with their own tile tune); sm100 runs `moe_fp4_sm100`'s block-scaled MMA kernel where K is a
    whole number of 128-deep steps; Ascend, c, fp32 and other K keep the portable body."""
    from tilekernels.ops import moe_fp4, moe_fp4_sm100

    kernel = DECLARED["moe_experts"].kernel("grouped_gemm_fp4")
    decode = moe_experts.variant(4096, 4096, 256, "bfloat16", fp4=True, tokens=1)
    prefill = moe_experts.variant(4096, 4096, 256, "bfloat16", fp4=True, tokens=512)
    for v in (decode, prefill):
        assert kernel.body_for("sm90", v) is not kernel.body
        assert kernel.body_for("sm100", v) is moe_fp4_sm100.body
        for target in ("ascend", "c"):
            assert kernel.body_for(target, v) is kernel.body
    assert kernel.body_for("sm100", moe_experts.variant(4096, 4000, 256, "bfloat16", fp4=True, tokens=1)) is kernel.body
    for target in ("sm90", "sm100"):
        assert kernel.body_for(target, moe_experts.variant(128, 128, 4, "float32", fp4=True, tokens=1)) is kernel.body
    assert moe_fp4.tune_for(decode.block_m) == moe_fp4.TUNE
    assert moe_fp4.tune_for(prefill.block_m) == moe_fp4.PREFILL_TUNE != moe_fp4.TUNE


@pytest.mark.parametrize("tokens", [1, 4096])
def test_the_sm100_fp4_kernel_lowers_to_the_block_scaled_mma(tokens):
    """Lowered only (no Blackwell GPU here): the override becomes MXFP8 block-scaled tcgen05 MMAs (e4m3 operands,
    one packed scale id per 32-deep K atom), with the scale words copied to tensor memory."""
    import backends
    from backends import tl
    from tilekernels.lang import Facade
    from tilekernels.ops import moe_fp4_sm100

    target = backends.get("sm100")
    v = moe_experts.variant(4096, 2048, 256, "bfloat16", fp4=True, tokens=tokens)
    src = tl.lower(moe_fp4_sm100.body(Facade(target.traits), v), target.tvm_target,
                   {**target.pass_configs, **moe_fp4_sm100.PASS_CONFIGS}, Path(tempfile.mkdtemp()), "k.cu",
                   library=False)["source"].read_text()
    assert "tcgen05mma_blockscaled_ss<tl::DataType::kFloat8_e4m3" in src
    assert src.count("tcgen05_cp<") == 2 and "tcgen05_sf_warp_transpose" in src and "fence_proxy_async" in src


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("fp4-experts")


@pytest.mark.parametrize("n, k, experts, tokens", [(64, 64, 4, 1), (192, 96, 5, 40), (64, 64, 4, 70)])
def test_portable_body_matches_reference_on_the_c_target(n, k, experts, tokens, cache):
    from tilekernels.kernels import kernel_table

    ops = kernel_table("c", cache)
    torch.manual_seed(tokens)
    args = moe_experts.example(moe_experts.Variant(n, k, experts, "float32", fp4=True), tokens, "cpu")
    atol, rtol = DECLARED["moe_experts"].tolerance["float32"]
    torch.testing.assert_close(ops.moe_experts(*args), moe_experts.reference(*args), atol=atol, rtol=rtol)


FLASH = [(4096, 4096), (4096, 2048)]  # V4-Flash gate_up (2I x H) and down (H x I)


@pytest.mark.parametrize("n, k", FLASH, ids=["gate_up", "down"])
def test_sm90_decode_override_builds_a_cubin(n, k, cache):
    from backends.nvidia import without_library

    v = moe_experts.variant(n, k, 256, "bfloat16", fp4=True, tokens=1)
    art = Compiler(without_library(backends.get("sm90")), cache).get(request("moe_experts", "grouped_gemm_fp4", v))
    source = art.file("cuda").read_text()
    assert "wgmma_rs" in source  # the converted weights feed the MMA from registers
    assert ("deepinfer_fp4x2_bf16x2" in source) == (moe_fp4.TUNE.decode == "pair")
    assert art.file("cubin").read_bytes()[:4] == b"\x7fELF"


@pytest.mark.parametrize("tune, n, k", [
    (moe_fp4.Tune(warp_specialized=True, min_blocks=2), 4096, 2048),  # (benchmarks/fp4_experts.py builds the rest)
    (moe_fp4.TUNE, 4000, 2112),  # ragged N and K: masked copies, the last K step's exponents clamped
], ids=["ws", "ragged"])
def test_other_decode_tiles_build(tune, n, k, cache):
    from backends.nvidia import without_library
    from codegen import Request
    from tilekernels.lang import Facade

    v = moe_experts.variant(n, k, 256, "bfloat16", fp4=True, tokens=1)
    req = Request("moe_experts", "grouped_gemm_fp4", v, lambda t: moe_fp4.body_decode(Facade(t.traits), v, None, tune),
                  lambda t: tune.pass_configs)
    art = Compiler(without_library(backends.get("sm90")), cache).get(req)
    assert art.file("cubin").read_bytes()[:4] == b"\x7fELF"


@pytest.mark.parametrize("name", ["sm100", "ascend"])
def test_portable_body_lowers_at_the_decode_tile(name):
    """gate_up's shape (down's differs only in N and K; `pytest -m full` lowers every V4-Flash shape per target)."""
    from backends import tl

    target = backends.get(name)
    n, k = FLASH[0]
    v = moe_experts.variant(n, k, 256, "bfloat16", fp4=True, tokens=1)
    assert "__global__" in tl.lower_source(request("moe_experts", "grouped_gemm_fp4", v).build(target), target)


def test_quantized_example_weights_fit_the_pair_decoder():
    """The pair decoder is exact for exponent bytes 1..254; real and synthetic FP4 experts use far fewer."""
    w = quantize(torch.randn(4, 64, 256) * 3, "fp4")
    e = (torch.log2(w.scales) + 127).round()
    assert int(e.min()) >= 3 and int(e.max()) <= 240
