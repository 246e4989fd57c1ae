"""Lightning-indexer scores: s[t, e] = sum_h w[t, h] * ReLU(q[t, h] . k[e]) * scale, in fp32, the keys read straight
from the index-key store by storage row: `rows` [S, E] (one key set per query: decode) or [E] (shared by every
query: a prefill chunk) into a store [N, dI] (V4's paged index keys, in the cache's dtype). Without `rows` the keys
themselves are passed, [E, dI] shared or [S, E, dI] per query (the kernel reads them as a store with rows 0..E-1, or
0..S*E-1 in query-major sets).

The kernel is `indexer_scores_fp4`'s design with keys stored as plain values: a work tile is (a block of `block_q`
queries, a tile of `block_e` keys); the tile's row ids are staged, each key row gathered by its id into the GEMM
operand (cast to q's dtype when the store's differs), and one GEMM keys (block_e x dI) x queries^T (block_q*nI x dI)
gives the fp32 logits of every (key, query head) pair; ReLU, times scale and the query's head weights, summed over
the heads, gives a (query, key) score. No gathered copy of the keys and no [S, nI, E] intermediate in global memory.

`run` pads what the tiles do not divide (`pad_rows`, `pad_queries`: shared with `indexer_scores_fp4`): the keys to
whole tiles (padding rows read storage row 0; their scores are dropped), with shared rows the queries to a multiple
of block_q (zero queries and weights), and at widths the tensor cores do not take (tiny models only) the heads to a
multiple of 16 and dI to a multiple of 32 with zeros (the store is then copied: never at V4 widths, nI 64, dI 128).
"""

from dataclasses import dataclass

import torch

from tilekernels import dtypes
from tilekernels.op import Kernel, OpDecl, Override, require
from tilekernels.ops import indexer_scores_sm90

NAME = "indexer_scores"
# Keys per tile (the GEMM's M) and queries per tile, for both indexer ops: per-query rows take 128 keys of one query;
# shared rows 64 keys of up to SHARED_BLOCK_Q queries, SHARED_COLUMNS query heads (the GEMM's N) at most.
BLOCK_E, SHARED_BLOCK_E, SHARED_BLOCK_Q, SHARED_COLUMNS = 128, 64, 4, 128
HEAD_ALIGN, DIM_ALIGN = 16, 32  # the GEMM's N and K granules on every target (run pads narrower models' q)


def reference(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, scale: float,
              rows: torch.Tensor | None = None) -> torch.Tensor:
    """q [S, nI, dI], keys [E, dI] (shared by every query) or [S, E, dI] (one key set per query), or with `rows`
    (int [S, E] or [E]) the store [N, dI] whose rows those are; weights [S, nI] -> scores [S, E] fp32."""
    if rows is not None:
        keys = keys[rows.long()]
    k = keys.float().transpose(-1, -2)
    scores = torch.matmul(q.float(), k if keys.dim() == 3 else k.unsqueeze(0))  # [S, nI, E]
    scores = torch.relu(scores) * scale
    return (scores * weights.float().unsqueeze(-1)).sum(dim=1)


@dataclass(frozen=True)
class Variant:
    heads: int  # nI (a multiple of HEAD_ALIGN: run pads)
    dim: int  # dI (a multiple of DIM_ALIGN: run pads)
    dtype: str  # q's dtype: the GEMM operands'
    shared: bool  # rows [E] shared by every query, else [S, E]
    block_q: int = 1  # queries per tile (shared rows only)
    block_e: int = BLOCK_E  # keys per tile
    keys: str | None = None  # the store's dtype where it differs from q's (the keys are cast on chip)


@dataclass(frozen=True)
class Config:
    threads: int = 128


def score_tile(P, threads: int, heads: int, block_q: int, block_e: int, direct: bool, tmem: bool):
    """The tail of both indexer kernels for one (query block, key tile): the staged keys k_io into the GEMM operand
    (unless they were written there), one GEMM keys x queries^T into the fp32 logits [key, query head] (through
    registers from tensor memory, `tmem`), then ReLU, times scale and the query's head weight, summed over the heads
    into the tile's scores."""
    T = P.T
    H, QB, BE, HE = heads, block_q, block_e, P.vec_rows(block_e)

    @T.macro
    def tile(k_io, k_op, q_op, acc, part, s_io, w_io, o_io, Out, qb0, ne, scale):
        if not direct:
            P.split_copy(k_io, k_op)
        P.gemm(k_op, q_op, acc, clear_accum=True)  # logits [key, query head]
        if tmem:
            T.copy(acc, part)
            T.copy(part, s_io)
        else:
            P.split_copy(acc, s_io)
        with P.vector(threads):
            sc = P.alloc_reg((HE, H), "float32")
            red = P.alloc_reg((HE,), "float32")
            for qb in range(QB):
                for i, h in T.Parallel(HE, H):  # the reference's order: ReLU, * scale, * weight
                    sc[i, h] = T.max(s_io[i, qb * H + h], 0.0) * scale * w_io[qb, h]
                T.reduce_sum(sc, red, dim=1)
                for i in T.Parallel(HE):
                    o_io[qb, 0, i] = red[i]
        P.split_copy(o_io, Out[qb0 * QB : qb0 * QB + QB, ne : ne + 1, 0:BE])

    return tile


def body(P, v: Variant, cfg: Config):
    require(v.dim % DIM_ALIGN == 0 and v.heads % HEAD_ALIGN == 0 and (v.shared or v.block_q == 1), NAME,
            f"variant {v}: heads must be a multiple of {HEAD_ALIGN}, dim of {DIM_ALIGN} (run pads), and block_q 1 "
            "unless the rows are shared")
    T = P.T
    H, D, dtype, BE, QB = v.heads, v.dim, v.dtype, v.block_e, v.block_q
    kdt = v.keys or dtype
    QH = QB * H  # GEMM columns
    HE = P.vec_rows(BE)  # keys per vector unit (Ascend: half the tile on each of its two)
    # Gather straight into the GEMM operand where vector code can write it (GPU shared memory, the c target);
    # Ascend gathers into UB and moves each unit's half to L1.
    direct = P.traits.operand_scope == P.traits.io_scope and not P.traits.vector_halves
    S = T.dynamic("S")  # queries (a multiple of QB)
    SQ = T.dynamic("SQ")  # S * nI query rows
    SR = T.dynamic("SR")  # row sets: S, or 1 when shared
    NE = T.dynamic("NE")  # key tiles
    N = T.dynamic("N")  # storage rows

    @T.prim_func
    def kernel(Q: T.Tensor((SQ, D), dtype), Store: T.Tensor((N, D), kdt), Rows: T.Tensor((SR, NE, BE), "int64"),
               W: T.Tensor((S, H), "float32"), Out: T.Tensor((S, NE, BE), "float32"), scale: T.float32):
        with P.kernel(S // QB * NE, cfg.threads) as pid:
            q_op = P.alloc_operand((QH, D), dtype)
            k_op = P.alloc_operand((BE, D), dtype)
            acc = P.alloc_acc((BE, QH), "float32", operands=dtype)
            # A tensor-memory accumulator (sm_100a) reaches shared memory through registers (indexer_scores_fp4)
            tmem = acc.scope() == "shared.tmem"
            part = T.alloc_fragment((BE, QH), "float32") if tmem else None
            scores = score_tile(P, cfg.threads, H, QB, BE, direct, tmem)
            rid_io = P.alloc_io((1, HE), "int64")
            k_io = k_op if direct else P.alloc_io((HE, D), dtype)
            w_io = P.alloc_io((QB, H), "float32")
            s_io = P.alloc_io((HE, QH), "float32")
            o_io = P.alloc_io((QB, 1, HE), "float32")
            for t in P.tiles(S // QB * NE, pid):
                qb0 = T.truncdiv(t, NE)  # key tiles minor: neighbouring programs share their queries
                ne = T.truncmod(t, NE)
                T.copy(Q[qb0 * QH : qb0 * QH + QH, 0:D], q_op)
                T.copy(W[qb0 * QB : qb0 * QB + QB, 0:H], w_io)
                P.split_copy(Rows[0 if v.shared else qb0, ne : ne + 1, 0:BE], rid_io)
                with P.vector(cfg.threads):  # gather this unit's keys by storage row
                    for i, d in T.Parallel(HE, D):
                        k_io[i, d] = T.cast(Store[rid_io[0, i], d], dtype) if kdt != dtype else Store[rid_io[0, i], d]
                scores(k_io, k_op, q_op, acc, part, s_io, w_io, o_io, Out, qb0, ne, scale)

    return kernel


# sm_90a: a prefill chunk's shared keys take indexer_scores_sm90's kernel (queries held, heads summed in registers);
# per-query rows (decode) and the batch-invariant tile keep the portable body everywhere.
KERNEL = Kernel(NAME, body, overrides=(Override("sm90", indexer_scores_sm90.fits, indexer_scores_sm90.body),),
                configs={"default": Config(), "c": Config(threads=1)})


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def variant(q: torch.Tensor, shared: bool, keys: torch.dtype | None = None, invariant: bool = False) -> Variant:
    """The kernel variant `run` launches for q [S, nI, dI] and a store of dtype `keys` (None: q's); no tensor values
    are read (meta tensors work). `invariant`: shared rows keep the per-query key tile (BLOCK_E), so that a score's
    head sum runs over the same register layout in prefill (shared keys) and decode (each query's own)."""
    _, heads, dim = q.shape
    h, d, name = _round_up(heads, HEAD_ALIGN), _round_up(dim, DIM_ALIGN), dtypes.name(q.dtype)
    kdt = None if keys is None or keys == q.dtype else dtypes.name(keys)
    if shared:
        block_e = BLOCK_E if invariant else SHARED_BLOCK_E
        return Variant(h, d, name, True, max(1, min(SHARED_BLOCK_Q, SHARED_COLUMNS // h)), block_e, kdt)
    return Variant(h, d, name, False, keys=kdt)


def pad_rows(rows: torch.Tensor, shared: bool, block_e: int) -> torch.Tensor:
    """Row ids [S, E] (or [E] shared) -> int64 [sets, NE, block_e] (sets: S, or 1), padded with storage row 0 to
    whole key tiles (their scores are dropped). No copy for int64 rows whose E the tiles divide."""
    e = rows.shape[-1]
    ne = -(-e // block_e)
    sets = rows.view(1, e) if shared else rows
    if e % block_e:
        idx = torch.zeros(sets.shape[0], ne * block_e, dtype=torch.int64, device=rows.device)
        idx[:, :e] = sets
    else:
        idx = sets.to(torch.int64).contiguous()
    return idx.view(-1, ne, block_e)


def pad_queries(q: torch.Tensor, weights: torch.Tensor, block_q: int, heads: int = 0, dim: int = 0):
    """q [S, nI, dI] and weights [S, nI], contiguous, with zero queries up to a multiple of `block_q` (and zero heads
    up to `heads`, zero columns up to `dim`): zero queries, heads and columns add nothing to any score."""
    s, h, d = q.shape
    sp = _round_up(s, block_q)
    if sp != s or heads > h or dim > d:
        q = torch.nn.functional.pad(q, (0, max(dim - d, 0), 0, max(heads - h, 0), 0, sp - s))
        weights = torch.nn.functional.pad(weights, (0, max(heads - h, 0), 0, sp - s))
    return q.contiguous(), weights.contiguous()


def unpad(out: torch.Tensor, s: int, e: int) -> torch.Tensor:
    """The kernel's [S', NE, block_e] scores -> [s, e] (a view when nothing was padded)."""
    out = out.view(out.shape[0], -1)
    return out if out.shape == (s, e) else out[:s, :e].contiguous()


def check_rows_weights(op: str, rows: torch.Tensor, weights: torch.Tensor, s: int, h: int) -> None:
    require(rows.dtype in (torch.int64, torch.int32), op, f"rows must be int64 (or int32), got {rows.dtype}")
    require(rows.dim() == 1 or (rows.dim() == 2 and rows.shape[0] == s), op,
            f"rows must be [S, E] = [{s}, E] or [E], got {list(rows.shape)}")
    require(weights.dtype == torch.float32 and tuple(weights.shape) == (s, h), op,
            f"weights must be float32 [S, nI] = [{s}, {h}], got {weights.dtype} {list(weights.shape)}")


def run(launch, q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, scale: float,
        rows: torch.Tensor | None = None) -> torch.Tensor:
    require(q.dim() == 3, NAME, f"q must be [S, nI, dI], got {list(q.shape)}")
    s, h, d = q.shape
    accepted = ", ".join(dtypes.NAMES.values())
    require(q.dtype in dtypes.NAMES, NAME, f"q must be one of {accepted}, got {q.dtype}")
    require(keys.dtype in dtypes.NAMES, NAME, f"keys must be one of {accepted}, got {keys.dtype}")
    if rows is None:  # the keys themselves: a store read at rows 0..E-1 (shared) or 0..S*E-1 (per query)
        require(keys.dim() in (2, 3) and keys.shape[-1] == d and (keys.dim() == 2 or keys.shape[0] == s), NAME,
                f"keys must be [E, dI] or [S, E, dI] with S = {s}, dI = {d} (or a store [N, dI] with rows), "
                f"got {list(keys.shape)}")
        rows = torch.arange(keys[..., 0].numel(), device=q.device).view(keys.shape[:-1])
        keys = keys.reshape(-1, d)
    require(keys.dim() == 2 and keys.shape[1] == d, NAME,
            f"keys must be a store [N, dI] = [N, {d}] when rows are given, got {list(keys.shape)}")
    check_rows_weights(NAME, rows, weights, s, h)
    e = rows.shape[-1]
    if s == 0 or e == 0:
        return torch.zeros(s, e, dtype=torch.float32, device=q.device)
    require(keys.shape[0] > 0, NAME, "rows given but the store has no rows")
    v = variant(q, rows.dim() == 1, keys.dtype, getattr(launch, "invariant", False))
    qq, w = pad_queries(q, weights, v.block_q, v.heads, v.dim)
    store = keys.contiguous() if v.dim == d else torch.nn.functional.pad(keys, (0, v.dim - d))
    idx = pad_rows(rows, v.shared, v.block_e)
    out = torch.empty(qq.shape[0], idx.shape[1], v.block_e, dtype=torch.float32, device=q.device)
    launch(NAME, v)(qq.view(-1, v.dim), store, idx, w, out, float(scale))
    return unpad(out, s, e)


def example(v: Variant, rows: int, device, keys: int = 37) -> tuple:
    """`rows` queries and `keys` keys each (per query, or shared), read (repeated, out of order) from a store of
    2 * keys + 5 rows ~ N(0, 1) in the store's dtype; q ~ N(0, 1) in v.dtype, weights ~ N(0, 1 / nI), scale dI^-0.5
    (the model's). Reference args: (q, store, weights, scale, rows)."""
    n = 2 * keys + 5
    store = torch.randn(n, v.dim, device=device).to(dtypes.torch_dtype(v.keys or v.dtype))
    ids = torch.randint(0, n, (keys,) if v.shared else (rows, keys), device=device)
    if keys > 1:
        ids[..., 1] = ids[..., 0]  # a repeat
    q = torch.randn(rows, v.heads, v.dim, device=device).to(dtypes.torch_dtype(v.dtype))
    w = torch.randn(rows, v.heads, device=device) * v.heads**-0.5
    return (q, store, w, v.dim**-0.5, ids)


def summation_bound(b: torch.Tensor, heads: int, dim: int, accumulate_ulps: float = 1.0) -> torch.Tensor:
    """|kernel - reference| <= this, elementwise, given B = the reference on absolute values (scale * sum_h |w_h|
    sum_d |q_hd k_ed|) when the products are exact in fp32 (bf16 or fp32 operands, no tf32): both sum dI products
    and nI head terms in fp32 in different orders, with 3 more roundings each (the product, * scale, * weight), so
    each is within gamma(dI + nI + 3) of the exact score relative to B; twice that, times `accumulate_ulps` for
    adders weaker than round-to-nearest (tensor cores)."""
    return b * (2 * (dim + heads + 3) * accumulate_ulps * 2.0**-24)


def error_bound(q, keys, weights, scale, rows=None, accumulate_ulps: float = 1.0) -> torch.Tensor:
    """The elementwise bound of |kernel - reference| [S, E] (`summation_bound`)."""
    b = reference(q.abs(), keys.abs(), weights.abs(), scale, rows)
    return summation_bound(b, q.shape[-2], q.shape[-1], accumulate_ulps)


OP = OpDecl(
    NAME, "lightning indexer scoring (ReLU MQA logits, head-weighted), keys read by storage row", reference,
    kernels=(KERNEL,),
    # fp32 summation order only (bf16 products are exact in fp32; fp32 operands on the c target): `error_bound` is
    # the elementwise bound the tests check; at V4-Flash widths (nI 64, dI 128) and `example`'s magnitudes B stays
    # below ~100 (scores ~1, up to ~6), so 2 * (128 + 64 + 3) * 2^-24 * 100 ~ 2.3e-3 absolute (x2 for tensor-core
    # adders) covers every score; a wrong head, key or scale moves a score by O(1). (fp32 operands on the GPUs'
    # tensor cores are tf32: ~2^-11 * B, outside this fp32 tolerance.)
    tolerance={"float32": (1e-2, 0.0), "bfloat16": (2e-2, 0.0)},
    run=run, example=example,
)
