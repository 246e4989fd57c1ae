"""Plain-PyTorch CPU stand-ins for DeepSeek-V4.1-Flash `inference/kernel.py` (TileLang).

Written for this harness (not copied from any port). The upstream kernel.py itself was NOT found in
any public copy reachable here; the semantics below come from (a) how upstream model.py calls each
function (see NOTES.md for line refs), and (b) the documented fidelity table and line citations
("K41:<line>") of Tenstorrent's CPU port of kernel.py (tt-metal,
models/demos/deepseek_v3_d_p/reference/deepseek_v41/{README.md,kernel_cpu.py}), which was written
against the real kernel.py. Where (b) is the only source it is said so.

Names and signatures are those model.py imports:
    act_quant, fp4_act_quant, fp4_gemm, fp8_gemm, hc_split_sinkhorn, sparse_attn

Precision modes
---------------
* Inputs in bf16 (the real model: `torch.set_default_dtype(torch.bfloat16)`, dtype="fp8"):
  the functions emulate the kernels' rounding: FP8/FP4 quant-dequant, bf16 probabilities in
  sparse_attn, bf16 outputs.
* Inputs in fp32 (the harness's fp32 mode): the same quantization grids are applied (KV/index
  caches are still FP8/FP4-rounded, as in the reference), but everything else stays fp32:
  sparse_attn does an exact fp32 softmax and returns fp32. The real kernels only accept bf16
  (tt-metal README: `in_dtype=BF16`), so fp32 input is an extension.
* Environment V41_CPU_NO_QAT=1 turns every *in-place* quantization (act_quant/fp4_act_quant with
  inplace=True) into the identity: a no-quantization oracle. This departs from the reference
  semantics and is off by default.

Exactness summary (details per function):
  fast_round_scale, act_quant, fp4_act_quant: exact element-wise ports (RNE casts, satfinite).
  fp8_gemm / fp4_gemm: exact block products, fp32 accumulation per 32-wide K block in K order;
      summation order inside a block differs from tensor cores (last-ulp fp32 differences).
  sparse_attn (bf16 input): online softmax over blocks of 64 like the kernel; exp and GEMM
      order differ -> ~1 bf16 ulp. (fp32 input): exact softmax, not a kernel emulation.
  hc_split_sinkhorn: same fp32 op order; exp/sigmoid last-ulp differences only.
"""

import os
from typing import Optional, Tuple

import torch

FP8_MAX = 448.0
FP4_MAX = 6.0
_FP8_MAX_INV = torch.tensor(1.0 / FP8_MAX, dtype=torch.float32)  # kernels multiply by an fp32 reciprocal
_FP4_MAX_INV = torch.tensor(1.0 / FP4_MAX, dtype=torch.float32)
SPARSE_ATTN_BLOCK = 64  # topk indices processed per online-softmax step (tt-metal cites K41:328)

# E2M1 magnitudes by 3-bit code; bit 3 is the sign.
_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float32)
FP4_TABLE = torch.cat([_E2M1, -_E2M1])
_E2M1_MIDS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float32)
# round-half-to-even on the code: a tie rounds up only when the upper code is even (codes 2, 4, 6)
_E2M1_TIE_UP = torch.tensor([False, True, False, True, False, True, False])


def _no_qat() -> bool:
    return os.environ.get("V41_CPU_NO_QAT", "0") == "1"


def fast_round_scale(amax: torch.Tensor, max_inv: torch.Tensor) -> torch.Tensor:
    """2 ** ceil(log2(amax * max_inv)) via the fp32 exponent/mantissa bits (exact; ue8m0 scales)."""
    x = (amax.float() * max_inv).contiguous()
    bits = x.view(torch.int32)
    exp = (bits >> 23) & 0xFF
    man = bits & ((1 << 23) - 1)
    log2_ceil = exp - 127 + (man != 0).to(torch.int32)
    return ((log2_ceil + 127) << 23).view(torch.float32)


def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> float8_e4m3fn, round-to-nearest-even, saturating (torch alone maps overflow to NaN)."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """fp32 in [-6, 6] -> 4-bit E2M1 codes (uint8), round-to-nearest-even."""
    mag = x.abs().unsqueeze(-1)
    code = (mag > _E2M1_MIDS).sum(-1) + ((mag == _E2M1_MIDS) & _E2M1_TIE_UP).sum(-1)
    return code.to(torch.uint8) | (torch.signbit(x).to(torch.uint8) << 3)


def e2m1_round(x: torch.Tensor) -> torch.Tensor:
    return FP4_TABLE[e2m1_codes(x).long()]


def unpack_fp4(w: torch.Tensor) -> torch.Tensor:
    """float4_e2m1fn_x2 [..., K//2] -> fp32 [..., K]; the low nibble holds the even element
    (the layout upstream convert.py packs, per tt-metal's port)."""
    b = w.view(torch.uint8)
    return torch.stack([FP4_TABLE[(b & 0x0F).long()], FP4_TABLE[(b >> 4).long()]], dim=-1).flatten(-2)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., K] -> float4_e2m1fn_x2 [..., K//2], even element in the low nibble."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous().view(torch.float4_e2m1fn_x2)


def act_quant(
    x: torch.Tensor,
    block_size: int = 128,
    scale_fmt: Optional[str] = None,
    scale_dtype: torch.dtype = torch.float32,
    inplace: bool = False,
):
    """Block-wise FP8 (e4m3) quantization along the last dim, one scale per `block_size` values.

    amax = max(|x_block|, 1e-4); s = 2^ceil(log2(amax/448)) if scale_fmt (ue8m0) else amax/448;
    q = e4m3_rne(clamp(x/s, +-448)). Returns (q, s.to(scale_dtype)), or with inplace=True writes
    q*s back into x (same dtype as x) and returns x. Exact port.
    """
    if inplace and _no_qat():
        return x
    N = x.size(-1)
    assert N % block_size == 0
    xg = x.float().unflatten(-1, (-1, block_size))
    amax = xg.abs().amax(dim=-1).clamp_min(1e-4)
    s = fast_round_scale(amax, _FP8_MAX_INV) if scale_fmt is not None else amax * _FP8_MAX_INV
    q = to_e4m3(xg / s.unsqueeze(-1))
    if inplace:
        x.copy_((q.float() * s.unsqueeze(-1)).flatten(-2).to(x.dtype))
        return x
    return q.flatten(-2), s.to(scale_dtype)


def fp4_act_quant(
    x: torch.Tensor,
    block_size: int = 32,
    inplace: bool = False,
    scale_dtype: torch.dtype = torch.float8_e8m0fnu,
):
    """Block-wise FP4 (e2m1) quantization along the last dim.

    scale_dtype e8m0 (indexer q/k, block 32): amax >= 6*2^-126, s = 2^ceil(log2(amax/6)).
    scale_dtype e4m3 (compressed KV latents, block 16): amax >= 6*2^-9, s = e4m3_rne(amax/6).
    q = e2m1_rne(clamp(x/s, +-6)). inplace=True writes q*s back into x. Exact port (the clamp
    constants and the e4m3-scale path are from tt-metal's port, citing K41:158-164).
    """
    if inplace and _no_qat():
        return x
    assert scale_dtype in (torch.float8_e8m0fnu, torch.float8_e4m3fn)
    N = x.size(-1)
    assert N % block_size == 0
    xg = x.float().unflatten(-1, (-1, block_size))
    amax = xg.abs().amax(dim=-1)
    if scale_dtype == torch.float8_e4m3fn:
        s = to_e4m3(amax.clamp_min(6 * 2.0**-9) / FP4_MAX).float()
    else:
        s = fast_round_scale(amax.clamp_min(6 * 2.0**-126), _FP4_MAX_INV)
    v = (xg / s.unsqueeze(-1)).clamp(-FP4_MAX, FP4_MAX)
    if inplace:
        x.copy_((e2m1_round(v) * s.unsqueeze(-1)).flatten(-2).to(x.dtype))
        return x
    return pack_fp4(e2m1_codes(v).flatten(-2)), s.to(scale_dtype)


def _block_scaled_gemm(a, a_s, b, b_s, block_k: int) -> torch.Tensor:
    """sum over K blocks of (A_k @ B_k^T) * a_s[:, k] * b_s[:, k], fp32, accumulated in K order."""
    M, K = a.shape
    acc = torch.zeros(M, b.size(0), dtype=torch.float32)
    for k in range(K // block_k):
        sl = slice(k * block_k, (k + 1) * block_k)
        acc += (a[:, sl] @ b[:, sl].T) * a_s[:, k : k + 1] * b_s[:, k].unsqueeze(0)
    return acc


def fp8_gemm(a, a_s, b, b_s, scale_dtype: torch.dtype = torch.float32, block_size: int = 128) -> torch.Tensor:
    """C[..., N] = A[..., K] @ B[N, K]^T. A e4m3 with one scale per (row, K block); B e4m3 with one
    scale per (N block, K block) (ceil-divided). Output in torch.get_default_dtype(), as upstream."""
    K = a.size(-1)
    M = a.numel() // K
    N = b.size(0)
    assert K % block_size == 0
    b_s_rows = b_s.float().repeat_interleave(block_size, dim=0)[:N]
    c = _block_scaled_gemm(a.reshape(M, K).float(), a_s.reshape(M, -1).float(), b.float(), b_s_rows, block_size)
    return c.to(torch.get_default_dtype()).view(*a.shape[:-1], N)


def fp4_gemm(a, a_s, b, b_s, scale_dtype: torch.dtype = torch.float32, act_block_size: int = 128) -> torch.Tensor:
    """C[..., N] = A_e4m3[..., K] @ B_e2m1[N, K]^T; B packed [N, K//2] (low nibble = even k) with
    one e8m0 scale per 32 along K; A scale per `act_block_size`. Output in default dtype."""
    K = a.size(-1)
    M = a.numel() // K
    N = b.size(0)
    assert K % act_block_size == 0 and b_s.shape == (N, K // 32)
    a_s32 = a_s.reshape(M, -1).float().repeat_interleave(act_block_size // 32, dim=1)
    c = _block_scaled_gemm(a.reshape(M, K).float(), a_s32, unpack_fp4(b), b_s.float(), 32)
    return c.to(torch.get_default_dtype()).view(*a.shape[:-1], N)


def sparse_attn(q: torch.Tensor, kv: torch.Tensor, attn_sink: torch.Tensor, topk_idxs: torch.Tensor, softmax_scale: float):
    """Single-KV-head sparse attention with a per-head sink.

    q [b, m, h, d]; kv [b, n, d] (K == V, the whole latent); attn_sink [h] fp32 (in scaled-logit
    units, not multiplied by softmax_scale); topk_idxs [b, m, k] int32 into kv's n axis, -1 = empty.
    o[b,m,h] = sum_j p_j kv[idx_j] with p_j = exp(s_j) / (sum_j exp(s_j) + exp(sink_h)),
    s_j = softmax_scale * q.kv[idx_j]. A row with no valid index gives 0. Output dtype = q.dtype.
    """
    b, m, h, d = q.shape
    k = topk_idxs.size(-1)
    batch = torch.arange(b).view(b, 1, 1)
    idx = topk_idxs.long()
    valid = idx >= 0
    kvg = kv.float()[batch, idx.clamp_min(0)] * valid.unsqueeze(-1)  # [b, m, k, d]
    if q.dtype != torch.bfloat16:
        # fp32 mode: exact softmax with the sink in the denominator
        s = torch.einsum("bmhd,bmkd->bmhk", q.float(), kvg) * softmax_scale
        s = s.masked_fill(~valid.unsqueeze(2), -torch.inf)
        mx = torch.maximum(s.amax(-1), attn_sink.float().view(1, 1, h))
        mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))
        p = torch.exp(s - mx.unsqueeze(-1))
        denom = p.sum(-1) + torch.exp(attn_sink.float().view(1, 1, h) - mx)
        o = torch.einsum("bmhk,bmkd->bmhd", p, kvg) / denom.unsqueeze(-1)
        o = torch.where(valid.any(-1).view(b, m, 1, 1), o, torch.zeros_like(o))
        return o.to(q.dtype)
    # bf16 mode: emulate the kernel's online softmax (blocks of 64, running max from -1e30,
    # fp32 sum of exp, probabilities cast to bf16 before PV, sink added at the end)
    qf = q.float()
    scale = torch.tensor(softmax_scale, dtype=torch.float32)
    acc = torch.zeros(b, m, h, d)
    sum_exp = torch.zeros(b, m, h)
    smax = torch.full((b, m, h), -1e30)
    for t in range(0, k, SPARSE_ATTN_BLOCK):
        vblk = valid[:, :, t : t + SPARSE_ATTN_BLOCK]
        kblk = kvg[:, :, t : t + SPARSE_ATTN_BLOCK]
        s = torch.einsum("bmhd,bmkd->bmhk", qf, kblk)
        s = torch.where(vblk.unsqueeze(2), s, -torch.inf) * scale
        prev = smax
        smax = torch.maximum(prev, s.amax(-1))
        corr = torch.exp(prev - smax)
        p = torch.exp(s - smax.unsqueeze(-1))
        sum_exp = sum_exp * corr + p.sum(-1)
        acc = acc * corr.unsqueeze(-1) + torch.einsum("bmhk,bmkd->bmhd", p.to(torch.bfloat16).float(), kblk)
    sum_exp = sum_exp + torch.exp(attn_sink.float() - smax)
    return (acc / sum_exp.unsqueeze(-1)).to(torch.bfloat16)


def hc_split_sinkhorn(
    mixes: torch.Tensor,
    hc_scale: torch.Tensor,
    hc_base: torch.Tensor,
    hc_mult: int = 4,
    sinkhorn_iters: int = 20,
    eps: float = 1e-6,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mixes [..., (2+hc)*hc] fp32 -> pre [..., hc], post [..., hc], comb [..., hc, hc] (fp32).

    pre  = sigmoid(m[:hc] * scale[0] + base[:hc]) + eps
    post = 2 * sigmoid(m[hc:2hc] * scale[1] + base[hc:2hc])
    comb = softmax_lastdim(m[2hc:] * scale[2] + base[2hc:]) + eps, then column-normalize
           (x / (colsum + eps)), then (iters-1) x [row-normalize, column-normalize] (all + eps).
    comb[i, j]: i indexes the residual copy being read, j the output copy (see Block.hc_post).
    """
    hc = hc_mult
    m = mixes.float()
    hc_scale = hc_scale.float()
    hc_base = hc_base.float()
    pre = torch.sigmoid(m[..., :hc] * hc_scale[0] + hc_base[:hc]) + eps
    post = 2 * torch.sigmoid(m[..., hc : 2 * hc] * hc_scale[1] + hc_base[hc : 2 * hc])
    comb = (m[..., 2 * hc :] * hc_scale[2] + hc_base[2 * hc :]).unflatten(-1, (hc, hc))
    comb = torch.exp(comb - comb.amax(dim=-1, keepdim=True))
    comb = comb / comb.sum(dim=-1, keepdim=True) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return pre, post, comb
