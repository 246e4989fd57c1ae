"""Engram gated write into the residual copies: per copy c, a normalized dot product of the stream with its
key, `dot = sum(h_c * q_c * k_c * key_c) * rsqrt(mean h_c^2 + eps) * rsqrt(mean key_c^2 + eps) / sqrt(D)`, a
signed square root (|dot| floored at 1e-6), a sigmoid gate, and `h_c += gate_c * value`. All math in fp32.

The kernel: one tile per (token, copy), the three sums in one pass over the row, as `rms_norm` does."""

from dataclasses import dataclass

import torch

from tilekernels import dtypes
from tilekernels.op import Kernel, OpDecl, require

DOT_FLOOR = 1e-6
MAX_DIM = 8192  # widths a tile takes: V4.1's hidden is 5120


def reference(streams: torch.Tensor, key: torch.Tensor, value: torch.Tensor, q_weight: torch.Tensor,
              k_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """streams [T, N, D], key [T, N, D], value [T, D], q_weight/k_weight [N, D] -> [T, N, D] in streams' dtype."""
    h, k = streams.float(), key.float()
    weight = q_weight.float() * k_weight.float()
    rstd = torch.rsqrt(h.square().mean(-1) + eps) * torch.rsqrt(k.square().mean(-1) + eps)
    dot = (h * weight * k).sum(-1) * rstd * h.shape[-1] ** -0.5
    gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(DOT_FLOOR).sqrt(), dot))
    return (h + gate.unsqueeze(-1) * value.float().unsqueeze(-2)).to(streams.dtype)


@dataclass(frozen=True)
class Variant:
    hc: int  # N copies
    dim: int  # D
    dtype: str  # the streams' dtype (key, value and the weights are read in fp32)


@dataclass(frozen=True)
class Config:
    threads: int = 128


def body(P, v: Variant, cfg: Config):
    T = P.T
    N, D, dtype = v.hc, v.dim, v.dtype
    DP = P.padded(D, cfg.threads)  # register width; == D when the threads divide it (no edge code emitted)
    M = T.dynamic("M")

    def at(j):  # a register column's index into the D-wide tiles (clamped in the padding)
        return j if DP == D else T.min(j, D - 1)

    def real(j, x):  # x in the columns of the row, 0 in the padding (adds nothing to the sums)
        return x if DP == D else T.if_then_else(j < D, x, 0.0)

    @T.prim_func
    def kernel(S: T.Tensor((M, N * D), dtype), Key: T.Tensor((M, N * D), "float32"), Value: T.Tensor((M, D), "float32"),
               Qw: T.Tensor((N, D), "float32"), Kw: T.Tensor((N, D), "float32"), Y: T.Tensor((M, N * D), dtype),
               eps: T.float32):
        with P.kernel(M * N, cfg.threads) as pid:
            h_io = P.alloc_io((D,), dtype)
            k_io = P.alloc_io((D,), "float32")
            v_io = P.alloc_io((D,), "float32")
            qw_io = P.alloc_io((D,), "float32")
            kw_io = P.alloc_io((D,), "float32")
            g_io = P.alloc_io((1,), "float32")
            for t in P.tiles(M * N, pid):
                row = t // N
                c = t % N
                T.copy(S[row, c * D : (c + 1) * D], h_io)
                T.copy(Key[row, c * D : (c + 1) * D], k_io)
                T.copy(Value[row, 0:D], v_io)
                T.copy(Qw[c, 0:D], qw_io)
                T.copy(Kw[c, 0:D], kw_io)
                with P.vector(cfg.threads):
                    hh = P.alloc_reg((DP,), "float32")
                    kk = P.alloc_reg((DP,), "float32")
                    hk = P.alloc_reg((DP,), "float32")
                    sh = P.alloc_reg((1,), "float32")
                    sk = P.alloc_reg((1,), "float32")
                    shk = P.alloc_reg((1,), "float32")
                    for j in T.Parallel(DP):
                        hh[j] = real(j, T.cast(h_io[at(j)], "float32") * T.cast(h_io[at(j)], "float32"))
                        kk[j] = real(j, k_io[at(j)] * k_io[at(j)])
                        hk[j] = real(j, T.cast(h_io[at(j)], "float32") * (qw_io[at(j)] * kw_io[at(j)]) * k_io[at(j)])
                    T.reduce_sum(hh, sh, dim=0)
                    T.reduce_sum(kk, sk, dim=0)
                    T.reduce_sum(hk, shk, dim=0)
                    for j in T.Parallel(1):
                        g_io[0] = shk[0] * (T.rsqrt(sh[0] / D + eps) * T.rsqrt(sk[0] / D + eps)) * (D ** -0.5)
                    for j in T.Parallel(1):  # sigmoid of the signed square root
                        g_io[0] = 1.0 / (1.0 + T.exp(-T.if_then_else(
                            g_io[0] < 0, -T.sqrt(T.max(-g_io[0], DOT_FLOOR)), T.sqrt(T.max(g_io[0], DOT_FLOOR)))))
                    for j in T.Parallel(D):
                        h_io[j] = T.cast(T.cast(h_io[j], "float32") + g_io[0] * v_io[j], dtype)
                T.copy(h_io, Y[row, c * D : (c + 1) * D])

    return kernel


KERNEL = Kernel("engram_gate", body, configs={"default": Config(), "c": Config(threads=1)})


def variant(streams: torch.Tensor) -> Variant:
    """The kernel variant `run` launches for these inputs (no tensor values are read: meta tensors work)."""
    _, n, d = streams.shape
    return Variant(hc=n, dim=d, dtype=dtypes.name(streams.dtype))


def run(launch, streams, key, value, q_weight, k_weight, eps):
    m, n, d = streams.shape
    require(key.shape == (m, n, d) and value.shape == (m, d) and q_weight.shape == (n, d) and k_weight.shape == (n, d),
            "engram_gate", f"key/value/q_weight/k_weight must be [{m}, {n}, {d}]/[{m}, {d}]/[{n}, {d}]/[{n}, {d}], got "
            f"{list(key.shape)}/{list(value.shape)}/{list(q_weight.shape)}/{list(k_weight.shape)}")
    require(d <= MAX_DIM, "engram_gate", f"the stream width {d} is more than the {MAX_DIM} columns a tile stages "
            "(five rows of it in shared memory / UB)")
    y = torch.empty(m, n * d, dtype=streams.dtype, device=streams.device)
    launch("engram_gate", variant(streams))(
        streams.reshape(m, n * d).contiguous(), key.float().reshape(m, n * d).contiguous(), value.float().contiguous(),
        q_weight.float().contiguous(), k_weight.float().contiguous(), y, float(eps))
    return y.view(m, n, d)


def example(v: Variant, rows: int, device) -> tuple:
    """Keys of both signs; one token's key is zero (the dot's floor)."""
    dtype = dtypes.torch_dtype(v.dtype)
    key = torch.randn(rows, v.hc, v.dim, device=device)
    key[0, 0] = 0.0
    return (torch.randn(rows, v.hc, v.dim, device=device).to(dtype), key, torch.randn(rows, v.dim, device=device),
            1 + 0.1 * torch.randn(v.hc, v.dim, device=device), 1 + 0.1 * torch.randn(v.hc, v.dim, device=device), 1e-6)


OP = OpDecl(
    "engram_gate", "Engram gated residual update of the mHC copies", reference,
    kernels=(KERNEL,),
    # fp32 sums in another order; bf16: plus one bf16 ulp of the output (at most 2^-7 relative)
    tolerance={"float32": (1e-5, 1e-5), "bfloat16": (1e-5, 2**-7)},
    run=run, example=example,
)
