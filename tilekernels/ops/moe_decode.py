"""The routed experts' bookkeeping at decode sizes in two kernels of `moe_experts` (portable bodies, every target):
`moe_route`, the expert-major layout of up to DECODE_TOKENS tokens' (token, slot) rows, and `moe_combine`, each
token's rows weighted in fp32 and summed in slot order.

Why: at one token the PyTorch ops they replace were 21 kernels per layer (the layout's one-hot running count,
cumsums, searchsorted; the combine's gather, product, sum and cast) taking ~39 us of a 115 us expert FFN on the
H200 (`benchmarks/profile_ops.py`, 2026-12-02), against ~75 us for its two GEMMs.

`moe_route` is one CTA: per expert lane the count of its rows (a pass over the R rows), its M tiles, the tiles of
the experts before it (a pass over the experts); per row lane its rank among its expert's rows (a pass over the
rows before it); per tile lane the expert whose tiles hold it (a pass over the experts). Serial passes of R and E
steps: ~1-3 us at R <= DECODE_TOKENS x top_k. It gives exactly `moe_experts.layout`'s result.
"""

from dataclasses import dataclass

import torch

from tilekernels.op import Kernel


@dataclass(frozen=True)
class RouteVariant:
    experts: int  # E
    block_m: int  # rows per M tile
    max_rows: int  # R bound: DECODE_TOKENS x top_k


@dataclass(frozen=True)
class CombineVariant:
    hidden: int  # H
    top_k: int  # slots per token
    dtype: str


@dataclass(frozen=True)
class Config:
    threads: int = 256
    chunk: int = 512  # combine: hidden columns per program


def tile_bound(rows: int, experts: int, bm: int) -> int:
    """M tiles of the padded layout of `rows` rows (each expert's rows start on a tile boundary): a static bound."""
    return -(-(rows + min(rows, experts) * (bm - 1)) // bm)


def route_body(P, v: RouteVariant, cfg: Config):
    T = P.T
    E, BM, RMAX = v.experts, v.block_m, v.max_rows
    th = cfg.threads
    EP, RP, TP = P.padded(E, th), P.padded(RMAX, th), P.padded(tile_bound(RMAX, E, BM), th)
    R = T.dynamic("R")
    NT = T.dynamic("NT")

    def one_if(cond, value=1):
        return T.if_then_else(cond, value, 0)

    @T.prim_func
    def kernel(Idx: T.Tensor((R,), "int64"), Dest: T.Tensor((R,), "int64"), Tiles: T.Tensor((NT,), "int32")):
        with P.kernel(1, th) as pid:
            idx_s = P.alloc_io((RP,), "int32")  # each row's expert (E past the last row: no expert)
            tiles_s = P.alloc_io((EP,), "int32")  # M tiles of each expert
            first_s = P.alloc_io((EP,), "int32")  # each expert's first row
            end_s = P.alloc_io((EP,), "int32")  # one past each expert's last tile
            for _ in P.tiles(1, pid):
                with P.vector(th):
                    for r in T.Parallel(RP):
                        idx_s[r] = T.if_then_else(r < R, T.cast(Idx[T.min(r, R - 1)], "int32"), E)
                with P.vector(th):
                    count = P.alloc_reg((EP,), "int32")
                    for e in T.Parallel(EP):
                        count[e] = 0
                    for r in T.serial(R):
                        for e in T.Parallel(EP):
                            count[e] = count[e] + one_if(idx_s[r] == e)
                    for e in T.Parallel(EP):
                        tiles_s[e] = (count[e] + (BM - 1)) // BM
                with P.vector(th):
                    end = P.alloc_reg((EP,), "int32")
                    for e in T.Parallel(EP):
                        end[e] = 0
                    for e2 in T.serial(E):
                        for e in T.Parallel(EP):
                            end[e] = end[e] + one_if(e2 <= e, tiles_s[e2])
                    for e in T.Parallel(EP):
                        end_s[e] = end[e]
                        first_s[e] = (end[e] - tiles_s[e]) * BM
                with P.vector(th):
                    rank = P.alloc_reg((RP,), "int32")
                    for r in T.Parallel(RP):
                        rank[r] = 0
                    for r2 in T.serial(R):
                        for r in T.Parallel(RP):
                            rank[r] = rank[r] + one_if(r2 < r, one_if(idx_s[r2] == idx_s[r]))
                    for r in T.Parallel(RP):
                        if r < R:
                            Dest[r] = T.cast(first_s[T.min(idx_s[r], E - 1)] + rank[r], "int64")
                with P.vector(th):
                    below = P.alloc_reg((TP,), "int32")  # experts whose tiles end at or before tile t
                    for t in T.Parallel(TP):
                        below[t] = 0
                    for e2 in T.serial(E):
                        for t in T.Parallel(TP):
                            below[t] = below[t] + one_if(end_s[e2] <= t)
                    for t in T.Parallel(TP):
                        if t < NT:
                            Tiles[t] = T.if_then_else(below[t] >= E, -1, below[t])

    return kernel


def combine_body(P, v: CombineVariant, cfg: Config):
    T = P.T
    H, K, dtype = v.hidden, v.top_k, v.dtype
    BH = min(cfg.chunk, P.padded(H, cfg.threads))  # columns per program, a multiple of the threads
    HC = -(-H // BH)
    M = T.dynamic("M")
    RT = T.dynamic("RT")

    @T.prim_func
    def kernel(Y: T.Tensor((RT, H), dtype), Dest: T.Tensor((M * K,), "int64"), W: T.Tensor((M, K), "float32"),
               Out: T.Tensor((M, H), dtype)):
        with P.kernel(M * HC, cfg.threads) as pid:
            y_io = P.alloc_io((BH,), dtype)
            w_io = P.alloc_io((K,), "float32")
            acc = P.alloc_vec((BH,), "float32")
            for t in P.tiles(M * HC, pid):
                tok = t // HC
                h0 = t % HC * BH
                T.copy(W[tok, 0:K], w_io)
                with P.vector(cfg.threads):
                    for j in T.Parallel(BH):
                        acc[j] = 0.0
                for k in T.serial(K):  # slot order, as the reference sums
                    T.copy(Y[Dest[tok * K + k], h0:h0 + BH], y_io)
                    with P.vector(cfg.threads):
                        for j in T.Parallel(BH):
                            acc[j] = acc[j] + w_io[k] * T.cast(y_io[j], "float32")
                with P.vector(cfg.threads):
                    for j in T.Parallel(BH):
                        if h0 + j < H:
                            Out[tok, h0 + j] = T.cast(acc[j], dtype)

    return kernel


_CPU = Config(threads=1, chunk=64)
ROUTE = Kernel("moe_route", route_body, configs={"default": Config(), "c": _CPU})
COMBINE = Kernel("moe_combine", combine_body, configs={"default": Config(threads=128), "c": _CPU})


def route(launch, indices: torch.Tensor, experts: int, bm: int, max_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`moe_experts.layout(indices, experts, bm)` by the `moe_route` kernel: (dest int64 [R], tiles int32 [NT])."""
    flat = indices.reshape(-1).long().contiguous()
    dest = torch.empty_like(flat)
    tiles = torch.empty(tile_bound(flat.numel(), experts, bm), dtype=torch.int32, device=flat.device)
    launch("moe_route", RouteVariant(experts, bm, max_rows))(flat, dest, tiles)
    return dest, tiles


def combine(launch, y: torch.Tensor, dest: torch.Tensor, weights: torch.Tensor, dtype: str) -> torch.Tensor:
    """out[t] = sum over slots s (in order) of weights[t, s] * y[dest[t * k + s]] in fp32, cast to y's dtype."""
    n_tok, top_k = weights.shape
    out = torch.empty(n_tok, y.shape[1], dtype=y.dtype, device=y.device)
    launch("moe_combine", CombineVariant(y.shape[1], top_k, dtype))(y, dest, weights.float().contiguous(), out)
    return out
