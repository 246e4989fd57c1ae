"""Compressor pooling: each window's entry is the per-channel softmax-over-slots weighted sum of its kv.

Callers and their shapes (kv [W, S, d], gate [W, S, d]; W = windows closing: the batch at decode, up to
thousands at prefill):
- V4 (`deepinfer/model/compressor.py`): CSA with its overlap S = 2 * 4 = 8 (d = head_dim 512, and its indexer's
  keys d = index_head_dim 128), HCA S = 128 (d = 512); kv in the cache's dtype (bf16 on the GPU), gate fp32
  (the fp32 position bias is added to it).
- V4.1 (`v41_compress.py`, `v41_decode.py`): S = the ratio 2, d = head_dim 512, kv and gate fp32.

Empty windows: CSA's first window has no predecessor, so its first `rate` slots are -inf (they weigh 0). No
caller builds a window whose every slot is -inf (the second series always comes from the projected tokens or
the zero-initialised buffer); if one came, the kernel gives what the reference gives: NaN in every channel.

The kernel: one tile per (window, block of channels); the S slots of the block staged, then per channel the
max over slots, the exp-weights' sum and the weighted kv sum, all in fp32, output cast once to kv's dtype. The
reference instead rounds the softmax weights (and each product) to kv's dtype before summing: see the
tolerances below.
"""

from dataclasses import dataclass

import torch

from tilekernels import dtypes
from tilekernels.op import Kernel, OpDecl, require


def reference(kv: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """kv [W, S, d], gate [W, S, d] (position bias added; -inf marks an empty slot) -> [W, d] in kv's dtype.

    The softmax over the S slots runs in fp32."""
    return (kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1)


MAX_SLOTS = 256  # the staged (S, block) tiles: 128 KiB of fp32 kv and gate at the GPU's 64-channel blocks


@dataclass(frozen=True)
class Variant:
    slots: int  # S
    dim: int  # d: channels
    dtype: str  # kv's (and the output's)
    gate_dtype: str = "float32"


@dataclass(frozen=True)
class Config:
    block: int = 64  # channels per tile (a multiple of `threads`)
    threads: int = 64


def body(P, v: Variant, cfg: Config):
    T = P.T
    S, D, dtype, gdtype = v.slots, v.dim, v.dtype, v.gate_dtype
    BD = min(cfg.block, D)
    NB = -(-D // BD)
    BP = P.padded(BD, cfg.threads)  # register width: == BD unless a narrow d is narrower than the threads
    # whole tiles are staged through on-chip buffers; a ragged last block (d % BD) or a padded register width
    # reads and writes global memory element-wise, clamped and predicated on the real width
    staged = D % BD == 0 and BP == BD
    SS, SB = (S, BD) if staged else (1, 1)
    W = T.dynamic("W")

    def gate_at(G, g_io, w, c0, s, j):
        if staged:
            return T.cast(g_io[s, j], "float32")
        return T.cast(G[w, s, T.min(c0 + j, D - 1)], "float32")

    def kv_at(KV, kv_io, w, c0, s, j):
        if staged:
            return T.cast(kv_io[s, j], "float32")
        return T.cast(KV[w, s, T.min(c0 + j, D - 1)], "float32")

    @T.prim_func
    def kernel(KV: T.Tensor((W, S, D), dtype), G: T.Tensor((W, S, D), gdtype), Out: T.Tensor((W, D), dtype)):
        with P.kernel(W * NB, cfg.threads) as pid:
            kv_io = P.alloc_io((SS, SB), dtype)
            g_io = P.alloc_io((SS, SB), gdtype)
            o_io = P.alloc_io((SB,), dtype)
            for t in P.tiles(W * NB, pid):
                w = t // NB
                c0 = (t % NB) * BD
                if staged:
                    T.copy(KV[w, 0:S, c0 : c0 + BD], kv_io)
                    T.copy(G[w, 0:S, c0 : c0 + BD], g_io)
                with P.vector(cfg.threads):
                    mx = P.alloc_reg((BP,), "float32")  # max over the slots (-inf when all are empty)
                    den = P.alloc_reg((BP,), "float32")  # sum of exp(gate - max)
                    acc = P.alloc_reg((BP,), "float32")  # sum of exp(gate - max) * kv
                    for j in T.Parallel(BP):
                        mx[j] = gate_at(G, g_io, w, c0, 0, j)
                        den[j] = 0.0
                        acc[j] = 0.0
                    for s in T.serial(1, S):
                        for j in T.Parallel(BP):
                            mx[j] = T.max(mx[j], gate_at(G, g_io, w, c0, s, j))
                    for s in T.serial(S):
                        for j in T.Parallel(BP):
                            e = T.exp(gate_at(G, g_io, w, c0, s, j) - mx[j])  # all empty: exp(nan) = nan
                            den[j] = den[j] + e
                            acc[j] = acc[j] + e * kv_at(KV, kv_io, w, c0, s, j)
                    for j in T.Parallel(BP):
                        if staged:
                            o_io[j] = T.cast(acc[j] / den[j], dtype)
                        else:
                            if c0 + j < D:
                                Out[w, c0 + j] = T.cast(acc[j] / den[j], dtype)
                if staged:
                    T.copy(o_io, Out[w, c0 : c0 + BD])

    return kernel


KERNEL = Kernel("compress_pool", body, configs={"default": Config(), "c": Config(block=64, threads=1)})
ACCEPTED = tuple(dtypes.NAMES)


def variant(kv: torch.Tensor, gate: torch.Tensor) -> Variant:
    """The kernel variant `run` launches for these inputs (no tensor values are read: meta tensors work)."""
    _, s, d = kv.shape
    return Variant(slots=s, dim=d, dtype=dtypes.name(kv.dtype), gate_dtype=dtypes.name(gate.dtype))


def run(launch, kv: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    op = "compress_pool"
    require(kv.dim() == 3, op, f"kv must be [W, S, d], got {list(kv.shape)}")
    require(gate.shape == kv.shape, op, f"gate must be kv's shape {list(kv.shape)}, got {list(gate.shape)}")
    for name, t in (("kv", kv), ("gate", gate)):
        require(t.dtype in ACCEPTED, op, f"{name} dtype {t.dtype} is not one of {[str(a) for a in ACCEPTED]}")
    w, s, d = kv.shape
    require(1 <= s <= MAX_SLOTS, op, f"slots per window S={s}; accepted: 1..{MAX_SLOTS}")
    require(d >= 1, op, f"channels d={d}; accepted: d >= 1")
    out = torch.empty(w, d, dtype=kv.dtype, device=kv.device)
    if w:  # no window closes (a short prefill chunk): nothing to launch
        launch("compress_pool", variant(kv, gate))(kv.contiguous(), gate.contiguous(), out)
    return out


def example(v: Variant, rows: int, device) -> tuple:
    """`rows` windows: kv in [-4, 4] (the range the tolerances are derived for), gates of spread ~3 with the
    first slot of every third window empty (-inf, as CSA's first window)."""
    kv = torch.randn(rows, v.slots, v.dim, device=device).clamp(-4, 4).to(dtypes.torch_dtype(v.dtype))
    gate = 3 * torch.randn(rows, v.slots, v.dim, device=device)
    if v.slots > 1:
        gate[::3, 0] = float("-inf")
    return (kv, gate.to(dtypes.torch_dtype(v.gate_dtype)))


OP = OpDecl(
    "compress_pool", "softmax-gated window pooling of the CSA/HCA compressors", reference,
    kernels=(KERNEL,),
    # Error against the reference, with m = max|kv| (the example keeps m <= 4) and u the unit roundoff of kv's
    # dtype: the reference rounds each softmax weight w_s and each product to kv's dtype (<= 2u of sum w_s|kv_s|
    # <= 2u m) and sums in another order; both round the sum to kv's dtype once (<= one ulp, 2u, relative).
    # bf16 (u = 2^-8): (2^-7 m, 2^-7) = (2^-5, 2^-7); fp16 (u = 2^-11): (2^-8, 2^-10). fp32: no rounding to a
    # narrower type, but S <= 128 terms summed in different orders and exps a few ulp apart:
    # (S + 16) 2^-24 m <= 3.5e-5.
    tolerance={"float32": (3.5e-5, 1e-6), "bfloat16": (2**-5, 2**-7), "float16": (2**-8, 2**-10)},
    run=run, example=example,
)
