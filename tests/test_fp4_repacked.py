"""The K-permuted FP4 expert layout (`moe_fp4.REPACKED`) on the CPU: the repack and its inverse, the layout flag
carried by the tensors, the load-time choice (which weights, which decoder, which targets), and the sm_90a
kernel's index formulas and decoders emulated in Python, through the op's own `run`."""

from __future__ import annotations

import pytest
import torch

import backends
from tilekernels.ops import moe_experts, moe_fp4, moe_fp4_sm90, swiglu
from tilekernels.quant import FP4_BLOCK, BlockQuantized, LayoutError, quantize

M32 = 0xFFFFFFFF


def fp4(e: int, n: int, k: int, lo: int = 100, hi: int = 129, seed: int = 0) -> BlockQuantized:
    g = torch.Generator().manual_seed(seed)
    values = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, generator=g)
    scales = torch.randint(lo, hi, (e, n, k // FP4_BLOCK[1]), dtype=torch.uint8, generator=g)
    return BlockQuantized(values, scales, FP4_BLOCK, "fp4")


@pytest.fixture
def repacked_on(monkeypatch):
    monkeypatch.setattr(moe_fp4, "REPACKED", True)


def sm90():
    return backends.get("sm90")


@pytest.mark.parametrize("decode", ["kperm", "kperm1"])
@pytest.mark.parametrize("block_m", [16, 64])
def test_repack_and_unpermute_round_trip_exactly(decode, block_m):
    w = fp4(2, 128, 512)
    values, scales = moe_fp4_sm90.repack(w.values, w.scales, moe_fp4.kperm_tune(block_m, decode))
    assert values.dtype == scales.dtype == torch.int32 and tuple(values.shape) == (2, 128, 64)
    assert not torch.equal(values.view(torch.uint8), w.values.reshape(2, 128, -1))  # really permuted
    back_v, back_s = moe_fp4_sm90.unpermute(values, scales)
    assert torch.equal(back_v, w.values) and torch.equal(back_s, w.scales)


def test_decode_and_prefill_tiles_share_one_layout():
    assert moe_fp4.kperm_tune(16, "kperm1").block_k == moe_fp4.kperm_tune(64, "kperm1").block_k == moe_fp4.KPERM_BLOCK_K
    assert moe_fp4.kperm_tune(64, "kperm").decode == "kperm" and moe_fp4.kperm_tune(64, "kperm").repacked


def test_load_time_repack_picks_the_decoder_from_the_exponents(repacked_on):
    small, large = fp4(3, 64, 256, hi=129), fp4(3, 64, 256, lo=120, hi=140)
    a, b = moe_experts.kernel_layout(small, sm90()), moe_experts.kernel_layout(large, sm90())
    assert a.layout == "kperm1" and a.scales.dtype == torch.int32
    assert b.layout == "kperm" and b.scales.dtype == torch.uint8
    for q, orig in ((a, small), (b, large)):
        assert q.values.dtype == torch.int32 and q.shape == orig.shape
        p = q.plain()
        assert p.layout == "plain" and torch.equal(p.values, orig.values) and torch.equal(p.scales, orig.scales)
        assert torch.equal(p.dequantize(), orig.dequantize())


def test_a_repacked_weight_refuses_a_plain_dequantize(repacked_on):
    q = moe_experts.kernel_layout(fp4(2, 64, 256), sm90())
    with pytest.raises(LayoutError, match="K-permuted"):
        q.dequantize()
    with pytest.raises(LayoutError):
        moe_experts.reference(torch.randn(2, 256), torch.ones(2, 1), torch.zeros(2, 1, dtype=torch.long),
                              q, q, 10.0)
    assert q.with_exponent_bytes() is q


def test_only_stacked_fp4_experts_on_a_reading_target_with_the_switch_on(monkeypatch):
    w = fp4(2, 64, 256)
    monkeypatch.setattr(moe_fp4, "REPACKED", False)
    assert moe_experts.kernel_layout(w, sm90()) is w  # the switch off: nothing changes
    monkeypatch.setattr(moe_fp4, "REPACKED", True)
    for name in ("c", "reference", "sm100", "ascend"):
        assert moe_experts.kernel_layout(w, backends.get(name)) is w
    two_d = BlockQuantized(w.values[0], w.scales[0], FP4_BLOCK, "fp4")
    assert moe_experts.kernel_layout(two_d, sm90()) is two_d
    ragged = fp4(2, 64, 160)  # K not a multiple of 256
    assert moe_experts.kernel_layout(ragged, sm90()) is ragged
    fp8 = quantize(torch.randn(2, 128, 256), "fp8")
    assert moe_experts.kernel_layout(fp8, sm90()) is fp8
    float_scales = BlockQuantized(w.values, (w.scales.float() - 127).exp2(), FP4_BLOCK, "fp4")
    assert moe_experts.kernel_layout(float_scales, sm90()) is float_scales  # for_kernels converts those first
    assert moe_experts.kernel_layout(w, sm90()).layout == "kperm1"
    assert w.to("cpu").layout == "plain"  # the CPU's target (the reference) keeps the plain layout


def test_expert_rows_keep_the_layout(repacked_on):
    from deepinfer.parallel.experts import rows

    for lo, hi in ((100, 129), (120, 140)):
        w = fp4(5, 128, 512, lo=lo, hi=hi)
        q = moe_experts.kernel_layout(w, sm90())
        idx = torch.tensor([4, 0, 2])
        picked = rows(q, idx)
        assert picked.layout == q.layout != "plain"
        assert torch.equal(picked.plain().values, w.values[idx]) and torch.equal(picked.plain().scales, w.scales[idx])
        assert q[3].layout == q.layout and torch.equal(q[1:3].plain().values, w.values[1:3])


def _bf16(bits: torch.Tensor) -> torch.Tensor:
    b = bits.to(torch.int32)
    return torch.where(b >= 1 << 15, b - (1 << 16), b).to(torch.int16).view(torch.bfloat16).float()


def emulate_tile_weights(words: torch.Tensor, exps: torch.Tensor, tune, n0: int, kk: int, k: int) -> torch.Tensor:
    """The (BN, BK) bf16 weight operand `moe_fp4_sm90.body` decodes for the tile at rows n0, K step kk, from
    one expert's K-permuted words [N, K/8] and exponent words [N, K/128]: its index formulas and its decoder."""
    bn, bk, ks = tune.block_n, tune.block_k, k // FP4_BLOCK[1]
    ww, sw = bk // 8, ks // 4
    w_s = (words[n0:n0 + bn, kk * ww:(kk + 1) * ww].long() & M32).reshape(-1)
    s_s = (exps[n0:n0 + bn].long() & M32).reshape(-1)
    i = torch.arange(bn)[:, None].expand(bn, bk)
    j = torch.arange(bk)[None, :].expand(bn, bk)
    h, a, ki = i % 16 // 8, j % 16 // 8, j // 16
    t = i % 64 // 16 * 32 + i % 8 * 4 + j % 8 // 2
    wf = i // 64 * (64 * ww) + (ki // 4 * 128 + t) * 4 + ki % 4
    b = ki % 16 // 2
    sf = i // 64 * (64 * sw) + (kk * (bk // moe_fp4_sm90.CHUNK) + ki // 16) * 128 + t // 4 * 4 + h * 2 + b // 4
    w, ew, sel, p, half = w_s[wf], s_s[sf], b % 4, h + 2 * a, j % 2
    r = torch.where(p == 0, w & 0x81C081C0, torch.where(p == 1, (w << 3) & 0x81C081C0, torch.where(
        p == 2, ((w << 6) & 0x01C001C0) | ((w << 1) & 0x80008000), ((w >> 3) & 0x01C001C0) | ((w << 2) & 0x80008000))))
    e = (ew >> (8 * sel)) & 0xFF
    v = _bf16((r & M32) >> (16 * half) & 0xFFFF)
    if tune.decode == "kperm":  # x 2^126 then x 2^(e-127), each rounded to bf16 (exact for these values)
        return (v * 2.0**126).to(torch.bfloat16).float() * (e.double() - 127).exp2().float()
    return v * (e.double() - 1).exp2().float()  # kperm1: one multiply by 2^(e-1)


class EmulatedLaunch:
    """A launcher whose K-permuted FP4 GEMMs run the emulation above tile by tile (the others: references)."""

    def __init__(self):
        self.kernels: list[tuple[str, int]] = []

    def op(self, name):
        assert name == "swiglu"
        return lambda kernel, v: (lambda rows, y, limit: y.copy_(swiglu.reference(rows, limit)))

    def __call__(self, kernel, v):
        if kernel == "moe_route":  # the layout and the weighted sum (tests/tilekernels/test_moe_decode.py) as torch
            return lambda flat, dest, tiles: (dest.copy_(moe_experts.layout(flat, v.experts, v.block_m)[0]),
                                              tiles.copy_(moe_experts.layout(flat, v.experts, v.block_m)[1]))
        if kernel == "moe_combine":
            return lambda y, dest, w, out: out.copy_((y[dest].view(*w.shape, -1).float() * w[..., None]).sum(1))
        self.kernels.append((kernel, v.block_m))
        decode = kernel.removeprefix("grouped_gemm_fp4_")
        assert decode in moe_fp4.KPERM, kernel
        tune = moe_fp4.kperm_tune(v.block_m, decode)

        def gemm(a, w, s, tiles, c):
            assert w.dtype == s.dtype == torch.int32
            for mt, expert in enumerate(tiles.tolist()):
                if expert < 0:
                    continue
                for n0 in range(0, v.n, tune.block_n):
                    acc = torch.zeros(v.block_m, tune.block_n)
                    for kk in range(v.k // tune.block_k):
                        wt = emulate_tile_weights(w[expert], s[expert], tune, n0, kk, v.k)
                        x = a[mt * v.block_m:(mt + 1) * v.block_m, kk * tune.block_k:(kk + 1) * tune.block_k]
                        acc += x.float() @ wt.T
                    c[mt * v.block_m:(mt + 1) * v.block_m, n0:n0 + tune.block_n] = acc.to(c.dtype)

        return gemm


@pytest.mark.parametrize("hi", [129, 140])  # every exponent byte <= 128 ("kperm1"), some above ("kperm")
@pytest.mark.parametrize("tokens", [3, moe_experts.DECODE_TOKENS + 1])  # decode (16-row) and prefill (64-row) tiles
def test_the_op_on_repacked_weights_matches_the_reference(repacked_on, tokens, hi):
    experts, hidden, inter, top = 4, 256, 256, 2  # K of both GEMMs: the layout's tile width
    g = torch.Generator().manual_seed(1)
    up = fp4(experts, 2 * inter, hidden, lo=hi - 20, hi=hi, seed=2)
    down = fp4(experts, hidden, inter, lo=hi - 20, hi=hi, seed=3)
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16) / 16
    idx = torch.rand(tokens, experts, generator=g).topk(top, -1).indices
    wts = torch.softmax(torch.randn(tokens, top, generator=g), -1)
    ru, rd = moe_experts.kernel_layout(up, sm90()), moe_experts.kernel_layout(down, sm90())
    assert ru.layout == rd.layout == ("kperm1" if hi <= 129 else "kperm")
    launch = EmulatedLaunch()
    out = moe_experts.run(launch, x, wts, idx, ru, rd, 10.0)
    ref = moe_experts.reference(x.float(), wts, idx, up, down, 10.0)
    assert {k for k, _ in launch.kernels} == {f"grouped_gemm_fp4_{ru.layout}"}
    bm = moe_experts.DECODE_BLOCK_M if tokens <= moe_experts.DECODE_TOKENS else moe_experts.BLOCK_M
    assert {m for _, m in launch.kernels} == {bm}
    assert (out.float() - ref).abs().max() <= 3e-2 * ref.abs().max() + 1e-6


def test_the_compile_plan_lists_the_repacked_kernels_only_with_the_switch(monkeypatch):
    from tilekernels.kernels import Recorder, table

    meta = torch.device("meta")
    up = BlockQuantized(torch.empty(8, 512, 128, dtype=torch.uint8, device=meta),
                        torch.empty(8, 512, 8, dtype=torch.uint8, device=meta), FP4_BLOCK, "fp4")
    down = BlockQuantized(torch.empty(8, 256, 128, dtype=torch.uint8, device=meta),
                          torch.empty(8, 256, 8, dtype=torch.uint8, device=meta), FP4_BLOCK, "fp4")
    x = torch.empty(2, 256, dtype=torch.bfloat16, device=meta)

    def kernels() -> set[str]:
        rec = Recorder()
        table(rec).moe_experts(x, torch.empty(2, 2, device=meta), torch.zeros(2, 2, dtype=torch.long, device=meta),
                               up, down, 10.0)
        return {k for op, k, _ in rec.seen if op == "moe_experts"}

    monkeypatch.setattr(moe_fp4, "REPACKED", False)
    assert kernels() == {"grouped_gemm_fp4", "moe_route", "moe_combine"}
    monkeypatch.setattr(moe_fp4, "REPACKED", True)
    assert kernels() == {"grouped_gemm_fp4", "grouped_gemm_fp4_kperm1", "moe_route", "moe_combine"}


@pytest.mark.parametrize("decode", ["kperm", "kperm1"])
@pytest.mark.parametrize("block_m", [moe_experts.DECODE_BLOCK_M, moe_experts.BLOCK_M])
def test_the_engine_kernels_lower_to_the_k_permuted_body_on_sm90_only(decode, block_m):
    from backends.tl import lower_source
    from tilekernels.kernels import request

    v = moe_experts.Variant(512, 512, 4, "bfloat16", block_m, True)
    req = request("moe_experts", f"grouped_gemm_fp4_{decode}", v)
    source = lower_source(req.build(sm90()), sm90())
    assert f"deepinfer_fp4_kperm_half<{'true' if decode == 'kperm' else 'false'}" in source
    assert moe_experts.reads_kperm(sm90(), 512, 512, 4)
    for name in ("sm100", "c"):  # what grouped_gemm_fp4 builds there, under the new name
        assert not moe_experts.reads_kperm(backends.get(name), 512, 512, 4)
        kernel = moe_experts.KERNELS_KPERM[decode]
        assert kernel.body_for(name, v) is moe_experts.KERNEL_FP4.body_for(name, v)
