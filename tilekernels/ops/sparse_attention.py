"""V4 attention core: every query head attends over one shared K=V head, at the KV rows its query lists
(sliding window + selected compressed entries), with a learned per-head sink in the softmax denominator.

Kernels: `split` runs flash-style online softmax over one split of a query's KV row list for a block of heads
and writes the unnormalised output with its running max and sum; `combine` merges the splits and the sink
with an online max/rescale; `whole` (the same body) takes a query's whole list when the plan has one split (a
prefill chunk, a large decode batch) and merges the sink itself: no fp32 partials, one kernel. The split count is a runtime size (the split dimension of Idx/Op/Stats): `run`
picks it from the context length, and one compiled variant serves every context. On sm90, variants of 64-head
groups with head dim 512 (V4-Flash) run `split` as a whole-kernel override (`sparse_attention_sm90`: all 64
heads per CTA, wgmma); the others, and every other target, run the portable bodies.

Edges: heads are padded to whole `block_h` tiles and the head dim to a multiple of `DIM_ALIGN` with zeros in
`run` (zero q/kv columns leave the scores unchanged; the extra output columns and heads are dropped), so the
GEMM tiles always divide. Both are no-ops at V4-Flash widths (64 heads, head dim 512).
"""

from dataclasses import dataclass, field

import torch

from tilekernels import dtypes
from tilekernels.op import Kernel, OpDecl, Override, require
from tilekernels.ops import sparse_attention_sm90 as hopper

_QUERY_BLOCK = 256  # bounds the gathered [block, K, D] tile of the reference


def reference(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sinks: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [S, H, D], kv [P, D] (K == V), indices [S, K] int (rows of kv; -1 = none), sinks [H] -> [S, H, D].

    Logits, softmax and the weighted sum run in fp32; the output is cast to q's dtype."""
    out = torch.empty_like(q)
    for start in range(0, q.shape[0], _QUERY_BLOCK):
        idx = indices[start : start + _QUERY_BLOCK]
        qb = q[start : start + _QUERY_BLOCK].float()
        rows = kv[idx.clamp(min=0)].float()  # [s, K, D]
        logits = torch.einsum("shd,skd->shk", qb, rows) * scale
        logits = logits.masked_fill((idx < 0).unsqueeze(1), float("-inf"))
        sink = sinks.float().view(1, -1, 1).expand(qb.shape[0], -1, 1)
        full = torch.cat([logits, sink], dim=-1)
        full = full - full.max(dim=-1, keepdim=True).values
        probs = torch.softmax(full, dim=-1)[..., :-1]
        out[start : start + _QUERY_BLOCK] = torch.einsum("shk,skd->shd", probs, rows).to(q.dtype)
    return out


@dataclass(frozen=True)
class Variant:
    heads: int  # padded to a multiple of block_h
    dim: int  # padded to a multiple of DIM_ALIGN
    dtype: str
    block_h: int = 16  # heads per tile
    block_k: int = 32  # KV rows per step (64 would need 320 KB of shared memory on sm_90a)


DIM_ALIGN = 32  # the head dim is the N of P@V: 4 warps x 8 columns of mma.sync on sm90 (and 16-wide Cube fractals)


@dataclass(frozen=True)
class Config:
    threads: int = 128
    sm90: hopper.Tune = field(default_factory=hopper.Tune)  # the sm90 override's tiles (sparse_attention_sm90)
    # The split count is a runtime size, so TileLang cannot prove the tile decomposition in bounds and would
    # guard every global access (with 64-bit divisions by the split count inside the KV loop: 20% slower on
    # the H200 at V4-Flash decode). Every index is in bounds by construction (run builds Idx/Op/Stats).
    pass_configs: dict = field(default_factory=lambda: {"tl.disable_safe_memory_legalize": True}, hash=False,
                               compare=False)


def split_body(P, v: Variant, cfg: Config):
    """One split of each query's row list: the unnormalised output and (running max, running sum) per head."""
    return _attention_body(P, v, cfg, whole=False)


def whole_body(P, v: Variant, cfg: Config):
    """A query's whole row list in one tile (a plan of one split): the sink merged in and the output normalised
    in the kernel (`combine`'s arithmetic), written in q's dtype: no fp32 partials, no second kernel."""
    return _attention_body(P, v, cfg, whole=True)


def _attention_body(P, v: Variant, cfg: Config, whole: bool):
    require(v.dim % DIM_ALIGN == 0 and v.heads % v.block_h == 0, "sparse_attention",
            f"the kernel takes dim a multiple of {DIM_ALIGN} and heads of {v.block_h}, got {v.dim}/{v.heads} (run pads)")
    T = P.T
    H, D, dtype, BH, BK = v.heads, v.dim, v.dtype, v.block_h, v.block_k
    HB = H // BH
    VR, HK = P.vec_rows(BH), P.vec_rows(BK)
    S, PR, NS, KB = T.dynamic("S"), T.dynamic("PR"), T.dynamic("NS"), T.dynamic("KB")

    @T.macro
    def attend(Q, KV, Idx, Op, Stats, Sinks, Out, scale):
        with P.kernel(S * HB * NS, cfg.threads) as pid:
            q_op = P.alloc_operand((BH, D), dtype)
            k_op = P.alloc_operand((BK, D), dtype)
            vt_op = P.alloc_operand((D, BK), dtype)
            p_op = P.alloc_operand((BH, BK), dtype)
            s_acc = P.alloc_acc((BH, BK), "float32")
            pv_acc = P.alloc_acc((BH, D), "float32")
            idx_io = P.alloc_io((1, BK), "int32")  # every index of the block (masking)
            half_io = P.alloc_io((1, HK), "int32")  # this vector unit's share of them (gathering)
            k_io = P.alloc_io((HK, D), dtype)
            vt_io = P.alloc_io((D, HK), dtype)
            s_io = P.alloc_io((VR, BK), "float32")
            p_io = P.alloc_io((VR, BK), dtype)
            pv_io = P.alloc_io((VR, D), "float32")
            o_vec = P.alloc_vec((VR, D), "float32")
            m_vec = P.alloc_vec((VR,), "float32")  # running max
            l_vec = P.alloc_vec((VR,), "float32")  # running sum
            a_vec = P.alloc_vec((VR,), "float32")
            st_io = P.alloc_io((VR, 2), "float32")
            sk_io = P.alloc_io((VR, 1), "float32") if whole else None
            out_io = P.alloc_io((VR, D), dtype) if whole else None
            for t in P.tiles(S * HB * NS, pid):
                # truncating (not floor) division: t and NS are non-negative, and the floor forms of a division
                # by a runtime size emit sign fix-ups in 64-bit arithmetic at every use
                s = T.truncdiv(t, HB * NS)
                h0 = T.truncmod(T.truncdiv(t, NS), HB) * BH
                sp = T.truncmod(t, NS)
                T.copy(Q[s, h0 : h0 + BH, 0:D], q_op)
                with P.vector(cfg.threads):
                    for i, d in T.Parallel(VR, D):
                        o_vec[i, d] = 0.0
                    for i in T.Parallel(VR):
                        m_vec[i] = -1e30
                        l_vec[i] = 0.0
                for kb in T.serial(KB):
                    T.copy(Idx[s, sp, kb : kb + 1, 0:BK], idx_io)
                    P.split_copy(Idx[s, sp, kb : kb + 1, 0:BK], half_io)
                    with P.vector(cfg.threads):  # gather this unit's rows (an empty slot reads row 0, masked below)
                        for r, d in T.Parallel(HK, D):
                            k_io[r, d] = KV[T.max(half_io[0, r], 0), d]
                        for d, r in T.Parallel(D, HK):
                            vt_io[d, r] = k_io[r, d]
                    P.split_copy(k_io, k_op)
                    P.split_copy(vt_io, vt_op)
                    P.gemm(q_op, k_op, s_acc, clear_accum=True)
                    P.split_copy(s_acc, s_io)
                    with P.vector(cfg.threads):
                        sc = P.alloc_reg((VR, BK), "float32")
                        mx = P.alloc_reg((VR,), "float32")
                        sm = P.alloc_reg((VR,), "float32")
                        for i, c in T.Parallel(VR, BK):
                            sc[i, c] = T.if_then_else(idx_io[0, c] >= 0, s_io[i, c] * scale, -T.infinity("float32"))
                        T.reduce_max(sc, mx, dim=1)
                        for i in T.Parallel(VR):
                            mx[i] = T.max(mx[i], m_vec[i])
                            a_vec[i] = T.exp(m_vec[i] - mx[i])
                            m_vec[i] = mx[i]
                        for i, c in T.Parallel(VR, BK):
                            sc[i, c] = T.exp(sc[i, c] - mx[i])
                            p_io[i, c] = T.cast(sc[i, c], dtype)
                        T.reduce_sum(sc, sm, dim=1)
                        for i in T.Parallel(VR):
                            l_vec[i] = l_vec[i] * a_vec[i] + sm[i]
                    P.split_copy(p_io, p_op)
                    P.gemm(p_op, vt_op, pv_acc, clear_accum=True)  # P @ V with V^T as the (N, K) operand
                    P.split_copy(pv_acc, pv_io)
                    with P.vector(cfg.threads):
                        for i, d in T.Parallel(VR, D):
                            o_vec[i, d] = o_vec[i, d] * a_vec[i] + pv_io[i, d]
                if whole:  # combine's merge with the sink as the only other part: o * b / (a + b * l)
                    P.split_copy(Sinks[h0 : h0 + BH, 0:1], sk_io)
                    with P.vector(cfg.threads):
                        for i in T.Parallel(VR):
                            top = T.max(sk_io[i, 0], m_vec[i])
                            a_vec[i] = T.exp(m_vec[i] - top) / (T.exp(sk_io[i, 0] - top)
                                                                + T.exp(m_vec[i] - top) * l_vec[i])
                        for i, d in T.Parallel(VR, D):
                            out_io[i, d] = T.cast(o_vec[i, d] * a_vec[i], dtype)
                    P.split_copy(out_io, Out[s, h0 : h0 + BH, 0:D])
                else:
                    with P.vector(cfg.threads):
                        for i in T.Parallel(VR):
                            st_io[i, 0] = m_vec[i]
                            st_io[i, 1] = l_vec[i]
                    P.split_copy(o_vec, Op[s, sp, h0 : h0 + BH, 0:D])
                    P.split_copy(st_io, Stats[s, sp, h0 : h0 + BH, 0:2])

    return hopper.prim_func(T, attend, v, whole, (S, PR, NS, KB))


def combine_body(P, v: Variant, cfg: Config):
    """Merge the splits of one (query, head block) with an online max/rescale: the sink starts the running
    max (m = sink, denominator 1), each split's (max, sum, unnormalised output) rescales in, then o / den."""
    require(v.dim % DIM_ALIGN == 0 and v.heads % v.block_h == 0, "sparse_attention",
            f"the kernel takes dim a multiple of {DIM_ALIGN} and heads of {v.block_h}, got {v.dim}/{v.heads} (run pads)")
    T = P.T
    H, D, dtype, BH = v.heads, v.dim, v.dtype, v.block_h
    HB = H // BH
    S, NS = T.dynamic("S"), T.dynamic("NS")

    @T.prim_func
    def kernel(Op: T.Tensor((S, NS, H, D), "float32"), Stats: T.Tensor((S, NS, H, 2), "float32"),
               Sinks: T.Tensor((H,), "float32"), Out: T.Tensor((S, H, D), dtype)):
        with P.kernel(S * HB, cfg.threads) as pid:
            st_io = P.alloc_io((BH, 2), "float32")
            m_io = P.alloc_io((BH,), "float32")  # running max
            den_io = P.alloc_io((BH,), "float32")  # running denominator (at the running max)
            a_io = P.alloc_io((BH,), "float32")  # rescale of what came before
            b_io = P.alloc_io((BH,), "float32")  # weight of this split
            part_io = P.alloc_io((BH, D), "float32")
            out_io = P.alloc_io((BH, D), dtype)
            o_vec = P.alloc_vec((BH, D), "float32")
            for t in P.tiles(S * HB, pid):
                s = t // HB
                h0 = t % HB * BH
                T.copy(Sinks[h0 : h0 + BH], m_io)
                with P.vector(cfg.threads):
                    for h in T.Parallel(BH):
                        den_io[h] = 1.0
                    for h, d in T.Parallel(BH, D):
                        o_vec[h, d] = 0.0
                for sp in T.Pipelined(NS, num_stages=2):  # the next split's loads overlap this one's update
                    T.copy(Stats[s, sp, h0 : h0 + BH, 0:2], st_io)
                    T.copy(Op[s, sp, h0 : h0 + BH, 0:D], part_io)
                    with P.vector(cfg.threads):
                        for h in T.Parallel(BH):
                            top = T.max(m_io[h], st_io[h, 0])
                            a_io[h] = T.exp(m_io[h] - top)
                            b_io[h] = T.exp(st_io[h, 0] - top)
                            den_io[h] = den_io[h] * a_io[h] + b_io[h] * st_io[h, 1]
                            m_io[h] = top
                        for h, d in T.Parallel(BH, D):
                            o_vec[h, d] = o_vec[h, d] * a_io[h] + b_io[h] * part_io[h, d]
                with P.vector(cfg.threads):
                    for h, d in T.Parallel(BH, D):
                        out_io[h, d] = T.cast(o_vec[h, d] / den_io[h], dtype)
                T.copy(out_io, Out[s, h0 : h0 + BH, 0:D])

    return kernel


_CONFIGS = {"default": Config(), "c": Config(threads=1)}
KERNELS = (Kernel("split", split_body, configs=_CONFIGS, overrides=(Override("sm90", hopper.fits, hopper.body),)),
           Kernel("combine", combine_body, configs=_CONFIGS),
           Kernel("whole", whole_body, configs=_CONFIGS, overrides=(Override("sm90", hopper.fits, hopper.whole_body),)))
MAX_SPLITS = 16
INVARIANT_SPLIT_ROWS = 256  # KV rows per split in batch-invariant mode (a multiple of hopper.SPLIT_ROWS)
INVARIANT_PARTIAL_BYTES = 1 << 30  # batch-invariant mode: queries per launch keep the fp32 partials below 1 GiB
TARGET_TILES = 256  # aim for at least this many tiles in flight when choosing splits


def plan(queries: int, heads: int, rows: int, block_h: int = 16, block_k: int = 32,
         wide: bool = False, invariant: bool = False) -> tuple[int, int]:
    """(splits, blocks per split) for `rows` KV rows per query: split until there are enough tiles.
    Runtime sizes only (the split count is no part of the variant). `wide`: variants that the sm90 override
    runs 64 heads to a CTA (`hopper.fits`): splits are whole `hopper.SPLIT_ROWS`-row steps, balanced, about
    `hopper.TARGET_CTAS` CTAs (one wave at one CTA per SM). Any split count is valid for the portable body.
    `invariant`: every split `INVARIANT_SPLIT_ROWS` rows of the list, whatever the batch: a query's rows fall in the
    same splits in prefill and decode (a longer list only adds empty splits, which merge as exact no-ops)."""
    blocks = max(1, -(-rows // block_k))
    if invariant:
        per_split = max(1, INVARIANT_SPLIT_ROWS // block_k)
        return -(-blocks // per_split), per_split
    if wide:
        group = max(1, hopper.SPLIT_ROWS // block_k)
        steps = -(-blocks // group)
        ctas = queries * -(-heads // hopper.HEADS)
        splits = max(1, min(MAX_SPLITS, steps, hopper.TARGET_CTAS // max(1, ctas)))
        per_split = -(-steps // splits)
        return -(-steps // per_split), per_split * group
    tiles = queries * (heads // block_h)
    splits = 1
    while splits < MAX_SPLITS and splits * 2 <= blocks and tiles * splits < TARGET_TILES:
        splits *= 2
    return splits, -(-blocks // splits)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def variant(q: torch.Tensor) -> Variant:
    """The kernel variant `run` launches for q [S, heads, dim] (heads and dim padded; no tensor values are read:
    meta tensors work). The same variant serves the split and the combine kernel."""
    _, heads, d = q.shape
    block_h = Variant.block_h
    return Variant(heads=_round_up(heads, block_h), dim=_round_up(d, DIM_ALIGN), dtype=dtypes.name(q.dtype))


def run(launch, q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sinks: torch.Tensor, scale: float):
    s, heads, d = q.shape
    require(kv.dim() == 2 and kv.shape[1] == d and kv.dtype == q.dtype, "sparse_attention",
            f"kv must be [rows, {d}] of {q.dtype}, got {list(kv.shape)} {kv.dtype}")
    v = variant(q)
    h, dp = v.heads, v.dim
    if h != heads or dp != d:  # zero heads/columns (tiny models): scores unchanged, dropped from the output
        q = torch.nn.functional.pad(q, (0, dp - d, 0, h - heads))
        sinks = torch.nn.functional.pad(sinks, (0, h - heads))
    if dp != d:
        kv = torch.nn.functional.pad(kv, (0, dp - d))
    invariant = getattr(launch, "invariant", False)
    splits, per_split = plan(s, h, indices.shape[1], v.block_h, v.block_k, hopper.fits(v), invariant)
    width = splits * per_split * v.block_k
    if indices.shape[1] == width:  # the lists fill the plan's blocks exactly (prefill's window and top-k)
        idx = indices.to(torch.int32).contiguous()
    else:
        idx = torch.full((s, width), -1, dtype=torch.int32, device=q.device)
        idx[:, : indices.shape[1]] = indices
    idx = idx.view(s, splits, per_split, v.block_k)
    q, kv, sinks = q.contiguous(), kv.contiguous(), sinks.float().contiguous()
    out = torch.empty_like(q)
    if splits == 1 and not invariant:  # one split: normalised in the kernel, no partials and no combine
        launch("whole", v)(q, kv, idx, sinks.view(-1, 1), out, float(scale))
    else:  # the invariant plan's splits do not shrink with many queries: launch them in groups (each query alone)
        group = max(1, INVARIANT_PARTIAL_BYTES // (splits * h * dp * 4)) if invariant else max(s, 1)
        for first in range(0, s, group):
            n = min(group, s - first)
            o_part = torch.empty(n, splits, h, dp, dtype=torch.float32, device=q.device)
            stats = torch.empty(n, splits, h, 2, dtype=torch.float32, device=q.device)
            launch("split", v)(q[first:first + n], kv, idx[first:first + n], o_part, stats, float(scale))
            launch("combine", v)(o_part, stats, sinks, out[first:first + n])
    if h != heads or dp != d:
        return out[:, :heads, :d].contiguous()
    return out


def example(v: Variant, rows: int, device, kv_rows: int = 640) -> tuple:
    """Inputs of a query block of `rows` queries with `kv_rows` listed KV rows each (7 empty slots), the first
    query listing a single valid row. `v.heads`/`v.dim` are used as given (run pads them when needed)."""
    dtype = dtypes.torch_dtype(v.dtype)
    q = torch.randn(rows, v.heads, v.dim, device=device).to(dtype)
    kv = torch.randn(kv_rows + 128, v.dim, device=device).to(dtype)
    idx = torch.randint(0, kv.shape[0], (rows, kv_rows), device=device)
    idx[:, -7:] = -1  # empty slots, as an indexer that picked fewer entries leaves them
    idx[0, :] = -1
    idx[0, 3] = 5  # a query with a single valid row
    return (q, kv, idx, torch.randn(v.heads, device=device), v.dim**-0.5)


OP = OpDecl(
    "sparse_attention", "MQA with sinks over per-query KV row lists (window + compressed)", reference,
    kernels=KERNELS,
    tolerance={"float32": (1e-4, 1e-4), "bfloat16": (2e-2, 2e-2)},
    run=run, example=example,
)
