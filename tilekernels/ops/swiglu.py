"""The V4 clipped SwiGLU: silu(min(gate, L)) * clamp(up, -L, L) over a fused [gate | up] input."""

from dataclasses import dataclass

import torch

from tilekernels import dtypes
from tilekernels.op import Arg, Kernel, OpDecl, require, tiles


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
    B, NB = tiles(I, cfg.block, "swiglu", "I")
    M = T.dynamic("M")

    @T.prim_func
    def kernel(GU: T.Tensor((M, 2 * I), dtype), Y: T.Tensor((M, I), dtype), limit: T.float32):
        with P.kernel(M * NB, cfg.threads) as pid:
            g_io = P.alloc_io((B,), dtype)
            u_io = P.alloc_io((B,), dtype)
            for t in P.tiles(M * NB, pid):
                row = t // NB
                col = (t % NB) * B
                T.copy(GU[row, col : col + B], g_io)
                T.copy(GU[row, I + col : I + col + B], u_io)
                with P.vector(cfg.threads):
                    for j in T.Parallel(B):
                        g = T.min(T.cast(g_io[j], "float32"), limit)
                        u = T.max(T.min(T.cast(u_io[j], "float32"), limit), -limit)
                        g_io[j] = T.cast(g / (1.0 + T.exp(-g)) * u, dtype)
                T.copy(g_io, Y[row, col : col + B])

    return kernel


KERNEL = Kernel("swiglu", body, configs={"default": Config(), "cpu": Config(threads=1)})


def run(launch, gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    inter = gate_up.shape[-1] // 2
    v = Variant(inter=inter, dtype=dtypes.name(gate_up.dtype))
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
    kernels=(KERNEL,), variant=Variant,
    signature=(Arg("gate_up", ("M", "2*inter"), "dtype"), Arg("y", ("M", "inter"), "dtype", "out")),
    tolerance={"float32": (1e-5, 1e-5), "bfloat16": (3e-2, 2e-2)},
    run=run, example=example,
)
