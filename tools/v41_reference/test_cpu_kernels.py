"""Self-checks of cpu_kernels.py against independent formulations. Run: python3.11 test_cpu_kernels.py"""

import torch

import cpu_kernels as K


def check(name, ok):
    print(("ok   " if ok else "FAIL ") + name)
    assert ok, name


torch.manual_seed(0)

# fast_round_scale == 2**ceil(log2(x)) for positive normals
x = torch.rand(1000) * 10 + 1e-3
ref = torch.exp2(torch.ceil(torch.log2(x * K._FP8_MAX_INV)))
check("fast_round_scale", torch.equal(K.fast_round_scale(x, K._FP8_MAX_INV), ref))

# e2m1 rounding: every grid point maps to itself; midpoints go to the even code
grid = K.FP4_TABLE
check("e2m1 grid fixed points", torch.equal(K.e2m1_round(grid), grid))
mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
check("e2m1 ties to even", torch.equal(K.e2m1_round(mids), torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0])))

# fp4 pack/unpack round trip
codes = torch.randint(0, 16, (5, 64), dtype=torch.uint8)
check("fp4 pack/unpack", torch.equal(K.unpack_fp4(K.pack_fp4(codes)), K.FP4_TABLE[codes.long()]))

# act_quant: inplace == dequant(non-inplace); error bounded by e4m3 precision
for dt in (torch.float32, torch.bfloat16):
    a = torch.randn(3, 7, 64).to(dt)
    q, s = K.act_quant(a.clone(), 32, "ue8m0", torch.float8_e8m0fnu)
    deq = (q.float().unflatten(-1, (-1, 32)) * s.float().unsqueeze(-1)).flatten(-2)
    b = a.clone()
    K.act_quant(b, 32, "ue8m0", torch.float8_e8m0fnu, True)
    check(f"act_quant inplace==dequant ({dt})", torch.equal(b, deq.to(dt)))
    check(f"act_quant error ({dt})", ((deq - a.float()).abs() <= a.float().abs() * 2**-4 + 1e-6).all().item())

# fp4_act_quant (both scale kinds): inplace == dequant(non-inplace)
for bs, sd in ((32, torch.float8_e8m0fnu), (16, torch.float8_e4m3fn)):
    a = torch.randn(2, 5, 64)
    q, s = K.fp4_act_quant(a.clone(), bs, False, sd)
    deq = (K.unpack_fp4(q).unflatten(-1, (-1, bs)) * s.float().unsqueeze(-1)).flatten(-2)
    b = a.clone()
    K.fp4_act_quant(b, bs, True, scale_dtype=sd)
    check(f"fp4_act_quant inplace==dequant (block {bs}, {sd})", torch.equal(b, deq))

# fp8_gemm / fp4_gemm == dequantized matmul
a = torch.randn(6, 96)
qa, sa = K.act_quant(a, 32, "ue8m0", torch.float8_e8m0fnu)
w = torch.randn(40, 96)
qw = K.to_e4m3(w)
sw = torch.full((2, 3), 0.5).to(torch.float8_e8m0fnu)
ad = (qa.float().unflatten(-1, (-1, 32)) * sa.float().unsqueeze(-1)).flatten(-2)
wd = qw.float() * 0.5
check("fp8_gemm", torch.allclose(K.fp8_gemm(qa, sa, qw, sw, block_size=32), ad @ wd.T, rtol=1e-5, atol=1e-4))
q4, s4 = K.fp4_act_quant(w.clone(), 32)
wd4 = (K.unpack_fp4(q4).unflatten(-1, (-1, 32)) * s4.float().unsqueeze(-1)).flatten(-2)
check("fp4_gemm", torch.allclose(K.fp4_gemm(qa, sa, q4, s4, act_block_size=32), ad @ wd4.T, rtol=1e-5, atol=1e-4))

# sparse_attn: fp32 path == dense softmax with a sink column; bf16 path close to it; -1 rows -> 0
b, m, h, d, n, k = 2, 3, 4, 64, 20, 9
q = torch.randn(b, m, h, d)
kv = torch.randn(b, n, d)
sink = torch.randn(h)
idx = torch.randint(0, n, (b, m, k), dtype=torch.int32)
idx[0, 0, 3:] = -1
idx[1, 2, :] = -1
scale = d**-0.5
out = K.sparse_attn(q, kv, sink, idx, scale)
ref = torch.zeros_like(out)
for bi in range(b):
    for mi in range(m):
        sel = idx[bi, mi][idx[bi, mi] >= 0].long()
        if sel.numel() == 0:
            continue
        kk = kv[bi, sel]
        logits = q[bi, mi] @ kk.T * scale  # [h, k']
        full = torch.cat([logits, sink[:, None]], -1).softmax(-1)[:, :-1]
        ref[bi, mi] = full @ kk
check("sparse_attn fp32 == dense reference", torch.allclose(out, ref, atol=1e-5))
check("sparse_attn empty row == 0", torch.equal(out[1, 2], torch.zeros(h, d)))
ob = K.sparse_attn(q.bfloat16(), kv.bfloat16(), sink, idx, scale)
check("sparse_attn bf16 close to fp32", (ob.float() - K.sparse_attn(q.bfloat16().float(), kv.bfloat16().float(), sink, idx, scale)).abs().max().item() < 3e-2)

# hc_split_sinkhorn: comb ~ doubly stochastic; pre/post ranges
mixes = torch.randn(5, 24)
pre, post, comb = K.hc_split_sinkhorn(mixes, torch.rand(3), torch.randn(24), 4, 20, 1e-6)
check("sinkhorn column sums ~1", torch.allclose(comb.sum(-2), torch.ones(5, 4), atol=1e-4))
check("sinkhorn row sums ~1", torch.allclose(comb.sum(-1), torch.ones(5, 4), atol=1e-2))
check("pre in (0,1+eps], post in (0,2)", bool((pre > 0).all() and (pre <= 1 + 1e-6).all() and (post > 0).all() and (post < 2).all()))
print("all cpu_kernels checks passed")
