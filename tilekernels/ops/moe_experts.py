"""Routed experts: for every (token, slot) run expert `indices[t, s]`'s clipped SwiGLU FFN and add it,
scaled by its routing weight (applied after the down projection), into the token's output.

Kernel path: the (token, slot) rows are sorted by expert into an expert-major layout where each expert's rows
start on a tile boundary (padding rows are zero); a grouped GEMM (each M tile belongs to one expert) computes
gate_up, the SwiGLU kernel activates, a second grouped GEMM computes down, and the weighted rows are added
back per token.
"""

from dataclasses import dataclass, field

import torch

from tilekernels import dtypes
from tilekernels.op import Arg, Kernel, OpDecl, require, tiles
from tilekernels.ops import swiglu


def reference(
    x: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    limit: float,
) -> torch.Tensor:
    """x [N, H], weights/indices [N, k], gate_up [E, 2I, H], down [E, H, I] -> [N, H]."""
    out = torch.zeros_like(x)
    flat = indices.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    tokens = order // indices.shape[1]
    slot_weights = weights.reshape(-1)[order]
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        tok = tokens[start : start + count]
        h = swiglu.reference(torch.nn.functional.linear(x[tok], gate_up[expert]), limit)
        y = torch.nn.functional.linear(h, down[expert]) * slot_weights[start : start + count, None]
        out.index_add_(0, tok, y.to(out.dtype))
        start += count
    return out


@dataclass(frozen=True)
class Variant:
    n: int  # output features
    k: int  # input features
    experts: int
    dtype: str
    block_m: int = 64  # rows per M tile; every expert's rows start on a tile boundary


@dataclass(frozen=True)
class Config:
    block_n: int = 128
    block_k: int = 64
    stages: int = 3
    threads: int = 128
    pass_configs: dict = field(default_factory=dict, hash=False, compare=False)


def body(P, v: Variant, cfg: Config):
    T = P.T
    N, K, E, BM, dtype = v.n, v.k, v.experts, v.block_m, v.dtype
    BN, NT = tiles(N, cfg.block_n, "moe_experts", "N")
    BK, KT = tiles(K, cfg.block_k, "moe_experts", "K")
    MT = T.dynamic("MT")  # M tiles (padded rows / BM)

    @T.prim_func
    def kernel(A: T.Tensor((MT * BM, K), dtype), W: T.Tensor((E, N, K), dtype), TileExpert: T.Tensor((MT,), "int32"),
               C: T.Tensor((MT * BM, N), dtype)):
        with P.kernel(MT * NT, cfg.threads) as pid:
            a_op = P.alloc_operand((BM, BK), dtype)
            b_op = P.alloc_operand((BN, BK), dtype)
            acc = P.alloc_acc((BM, BN), "float32")
            for t in P.tiles(MT * NT, pid):
                m0 = t // NT * BM
                n0 = t % NT * BN
                if TileExpert[t // NT] >= 0:
                    for kk in T.Pipelined(KT, num_stages=cfg.stages):
                        T.copy(A[m0, kk * BK], a_op)
                        T.copy(W[TileExpert[t // NT], n0, kk * BK], b_op)
                        P.gemm(a_op, b_op, acc, clear_accum=kk == 0)
                    P.store_acc(acc, C[m0, n0])

    return kernel


KERNEL = Kernel("grouped_gemm", body, configs={
    "default": Config(),
    "sm100": Config(block_n=128, block_k=64, stages=3, threads=128),
    "ascend": Config(block_n=128, block_k=64, stages=2, threads=0),
    "cpu": Config(block_n=16, block_k=16, stages=0, threads=1),
})
BLOCK_M = 64


def layout(indices: torch.Tensor, experts: int, bm: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert-major padded layout without a host sync (CUDA-graph safe): the destination row of every
    (token, slot) in flat order, and the expert of each M tile (-1 past the last expert's rows). Each expert's
    rows start on a tile boundary; the tile count is the static bound ceil((R + E*(bm-1)) / bm)."""
    flat = indices.reshape(-1)
    counts = torch.zeros(experts, dtype=torch.long, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # bincount without its host sync
    padded = (counts + bm - 1) // bm * bm
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    order = torch.argsort(flat, stable=True)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=order.device)
    first = torch.cumsum(counts, 0) - counts  # sorted position of each expert's first row
    dest = starts[flat] + rank - first[flat]
    n_tiles = -(-(flat.numel() + experts * (bm - 1)) // bm)
    tile_start = torch.arange(n_tiles, device=flat.device) * bm
    expert = torch.searchsorted(ends, tile_start, right=True)
    tiles = torch.where(expert < experts, expert, torch.full_like(expert, -1)).to(torch.int32)
    return dest, tiles


def run(launch, x, weights, indices, gate_up, down, limit):
    n_tok, hidden = x.shape
    experts, two_i, _ = gate_up.shape
    inter = two_i // 2
    require(gate_up.shape[2] == hidden and down.shape == (experts, hidden, inter), "moe_experts",
            f"gate_up must be [E, 2I, {hidden}] and down [E, {hidden}, I]; got {list(gate_up.shape)}, {list(down.shape)}")
    require(x.dtype == gate_up.dtype == down.dtype, "moe_experts", f"x, gate_up, down dtypes differ: "
            f"{x.dtype}, {gate_up.dtype}, {down.dtype}")
    dtype = dtypes.name(x.dtype)
    dest, tiles = layout(indices, experts, BLOCK_M)
    total = tiles.numel() * BLOCK_M
    token_of = torch.arange(n_tok, device=x.device).repeat_interleave(indices.shape[1])
    rows = torch.empty(total, hidden, dtype=x.dtype, device=x.device)  # padding rows' results are never read
    rows[dest] = x[token_of]
    h = torch.empty(total, two_i, dtype=x.dtype, device=x.device)
    launch("grouped_gemm", Variant(two_i, hidden, experts, dtype, BLOCK_M))(rows, gate_up, tiles, h)
    a = swiglu.run(launch.op("swiglu"), h, limit)
    y = torch.empty(total, hidden, dtype=x.dtype, device=x.device)
    launch("grouped_gemm", Variant(hidden, inter, experts, dtype, BLOCK_M))(a, down, tiles, y)
    out = torch.zeros(n_tok, hidden, dtype=torch.float32, device=x.device)
    out.index_add_(0, token_of, y[dest].float() * weights.reshape(-1, 1).float())
    return out.to(x.dtype)


def example(v: Variant, rows: int, device) -> tuple:
    """Reference args for a token batch of `rows` on a layer with v.experts experts (v.n = 2I, v.k = H)."""
    dtype = dtypes.torch_dtype(v.dtype)
    inter, hidden, top_k = v.n // 2, v.k, 6 if v.experts >= 6 else 1
    x = torch.randn(rows, hidden, device=device).to(dtype)
    scores = torch.rand(rows, v.experts, device=device)
    indices = scores.topk(top_k, dim=-1).indices
    weights = torch.softmax(torch.randn(rows, top_k, device=device), -1)
    gate_up = (torch.randn(v.experts, 2 * inter, hidden, device=device) / hidden**0.5).to(dtype)
    down = (torch.randn(v.experts, hidden, inter, device=device) / inter**0.5).to(dtype)
    return (x, weights, indices, gate_up, down, 10.0)


OP = OpDecl(
    "moe_experts", "grouped expert GEMMs (gate_up, clipped SwiGLU, down) with weighted combine", reference,
    kernels=(KERNEL,), variant=Variant,
    signature=(Arg("rows", ("MT*block_m", "k"), "dtype"), Arg("weight", ("experts", "n", "k"), "dtype"),
               Arg("tile_expert", ("MT",), "int32"), Arg("out", ("MT*block_m", "n"), "dtype", "out")),
    tolerance={"float32": (1e-4, 1e-4), "bfloat16": (3e-2, 3e-2)},
    run=run, example=example, uses=("swiglu",),
)
