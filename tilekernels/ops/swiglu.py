"""The V4 clipped SwiGLU: silu(min(gate, L)) * clamp(up, -L, L) over a fused [gate | up] input."""

from dataclasses import dataclass

import torch

from tilekernels import dtypes
from tilekernels.op import Kernel, OpDecl, require


def reference(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    """gate_up [..., 2I] (gate = first I, up = second I) -> [..., I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return torch.nn.functional.silu(gate) * up


@dataclass(frozen=True)
class Variant:
    inter: int  # I: output width (input is 2I wide)
    dtype: str


@dataclass(frozen=True)
class Config:
    block: int = 512
    threads: int = 128


def body(P, v: Variant, cfg: Config):
    T = P.T
    I, dtype = v.inter, v.dtype
    B = min(cfg.block, I)
    NB = -(-I // B)  # the last block is partial when B does not divide I
    M = T.dynamic("M")

    def act(g, u, limit):
        g = T.min(g, limit)
        u = T.max(T.min(u, limit), -limit)
        return g / (1.0 + T.exp(-g)) * u

    @T.prim_func
    def kernel(GU: T.Tensor((M, 2 * I), dtype), Y: T.Tensor((M, I), dtype), limit: T.float32):
        with P.kernel(M * NB, cfg.threads) as pid:
            g_io = P.alloc_io((B,), dtype)
            u_io = P.alloc_io((B,), dtype)
            for t in P.tiles(M * NB, pid):
                row = t // NB
                col = (t % NB) * B
                if I % B == 0:
                    T.copy(GU[row, col : col + B], g_io)
                    T.copy(GU[row, I + col : I + col + B], u_io)
                    with P.vector(cfg.threads):
                        for j in T.Parallel(B):
                            g_io[j] = T.cast(act(T.cast(g_io[j], "float32"), T.cast(u_io[j], "float32"), limit), dtype)
                    T.copy(g_io, Y[row, col : col + B])
                else:  # ragged tail: element-wise straight from/to global memory, predicated on the real width
                    with P.vector(cfg.threads):
                        for j in T.Parallel(B):
                            if col + j < I:
                                Y[row, col + j] = T.cast(act(T.cast(GU[row, col + j], "float32"),
                                                             T.cast(GU[row, I + col + j], "float32"), limit), dtype)

    return kernel


KERNEL = Kernel("swiglu", body, configs={"default": Config(), "c": Config(threads=1)})


def variant(gate_up: torch.Tensor) -> Variant:
    """The kernel variant `run` launches for these inputs (no tensor values are read: meta tensors work)."""
    return Variant(inter=gate_up.shape[-1] // 2, dtype=dtypes.name(gate_up.dtype))


def run(launch, gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    v = variant(gate_up)
    inter = v.inter
    require(gate_up.shape[-1] % 2 == 0 and gate_up.is_contiguous(), "swiglu",
            f"gate_up must be contiguous with an even last dim, got {list(gate_up.shape)}")
    rows = gate_up.reshape(-1, 2 * inter)
    y = torch.empty(rows.shape[0], inter, dtype=gate_up.dtype, device=gate_up.device)
    launch("swiglu", v)(rows, y, float(limit))
    return y.view(*gate_up.shape[:-1], inter)


def example(v: Variant, rows: int, device) -> tuple:
    return ((torch.randn(rows, 2 * v.inter, device=device) * 6).to(dtypes.torch_dtype(v.dtype)), 10.0)


OP = OpDecl(
    "swiglu", "clipped SwiGLU activation", reference,
    kernels=(KERNEL,),
    tolerance={"float32": (1e-5, 1e-5), "bfloat16": (3e-2, 2e-2)},
    run=run, example=example,
)
