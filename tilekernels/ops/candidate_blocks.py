"""V4.1's first top-k level: per query, keep the `topk_blocks` best blocks of `block_size` consecutive
compressed positions (a block scores its best position); the block holding the query's newest visible
position is always kept. The later index sources pick their own top-k only inside these blocks.

The kernel (one tile per query) is the cheapest correct one, not a fast top-k: block maxima into a workspace as
order-preserving int32 keys; when more than `topk_blocks` blocks are finite, the k-th largest rank key (the
block's key, then its index, lower first: all distinct) bit by bit, one counting pass over the blocks per bit
(57 passes); finally the mask. Below 16K visible positions (2048 blocks of 8) every finite block is kept
and only the maxima and the mask are computed. Ties at the k-th key go to the lower block, in the reference too
(`indexer_topk.top_indices`: V4.1's FP4-rounded index scores tie exactly, and a tie must not depend on chunking)."""

from dataclasses import dataclass

import torch

from tilekernels.op import Kernel, OpDecl, require
from tilekernels.ops.indexer_topk import top_indices


def reference(scores: torch.Tensor, visible: torch.Tensor, topk_blocks: int, block_size: int) -> torch.Tensor:
    """scores [S, E] fp32 (-inf at positions the query cannot see), visible [S] int (positions < visible[s] are
    seen; 0: none) -> bool [S, E]: the positions of each query's kept blocks. A block with no finite score is
    never kept, except the one holding the query's newest visible position."""
    s, e = scores.shape
    blocks = -(-e // block_size)
    padded = torch.nn.functional.pad(scores.float(), (0, blocks * block_size - e), value=float("-inf"))
    best = padded.view(s, blocks, block_size).amax(-1)
    newest = (visible.view(-1, 1) - 1) // block_size
    best = best.masked_fill(torch.arange(blocks, device=scores.device).view(1, -1) == newest, float("inf"))
    picks = top_indices(best, min(topk_blocks, blocks))
    keep = torch.zeros_like(best, dtype=torch.bool).scatter_(-1, picks, best.gather(-1, picks) > float("-inf"))
    return keep.repeat_interleave(block_size, dim=-1)[:, :e]


@dataclass(frozen=True)
class Variant:
    block_size: int
    topk_blocks: int


@dataclass(frozen=True)
class Config:
    chunk: int = 128  # blocks per step of a counting pass
    threads: int = 128


NEG_INF_KEY = -2139095041  # the key of -inf: its bits 0xFF800000 ^ 0x7FFFFFFF as int32
POS_INF = 2139095040  # the bits of +inf, its own key
INDEX_BITS = 24  # block indices in a rank key: at most 2^24 - 1 blocks (the counts run in fp32, exact below 2^24)


def body(P, v: Variant, cfg: Config):
    T = P.T
    BS, K, BC = v.block_size, v.topk_blocks, cfg.chunk
    BSP = 1 << (BS - 1).bit_length()  # the maxima's register width, a power of two (layout inference needs one)
    S, E, NB = T.dynamic("S"), T.dynamic("E"), T.dynamic("NB")  # queries, positions, blocks (ceil(E / BS))

    def key(x):  # order-preserving int32 key of an fp32 value: the bits, negatives' magnitude bits flipped
        bits = T.reinterpret(x, "int32")
        return T.if_then_else(bits < 0, T.bitwise_xor(bits, 0x7FFFFFFF), bits)

    def rank_key(k, b):  # unique, non-negative int64: the block's key, then the lower index first
        return k * (1 << INDEX_BITS) + ((1 << INDEX_BITS) - 1 - b) + (1 << (31 + INDEX_BITS))

    @T.macro
    def step(Keys, q, st, cnt, bit):
        """One bit of the K-th largest rank key st[0]: try st[0] + 2^bit (st[1]), keep it if at least K finite
        blocks rank at or above it. One vector region per chunk of blocks (Ascend schedules each region)."""
        for c in T.serial(T.ceildiv(NB, BC)):
            with P.vector(cfg.threads):
                hits = P.alloc_reg((BC,), "float32")
                tot = P.alloc_reg((1,), "float32")
                for i in T.Parallel(1):
                    if c == 0:
                        st[1] = st[0] + T.shift_left(T.int64(1), T.cast(bit, "int64"))
                        cnt[0] = 0.0
                for i in T.Parallel(BC):
                    k = T.cast(Keys[q, T.min(c * BC + i, NB - 1)], "int64")
                    hits[i] = T.if_then_else(T.And(T.And(c * BC + i < NB, k > NEG_INF_KEY),
                                                   rank_key(k, T.cast(c * BC + i, "int64")) >= st[1]), 1.0, 0.0)
                T.reduce_sum(hits, tot, dim=0)  # counts in fp32: exact below 2^24 blocks
                for i in T.Parallel(1):
                    cnt[0] = cnt[0] + tot[0]
                    if c == T.ceildiv(NB, BC) - 1:
                        if cnt[0] >= K:
                            st[0] = st[1]

    @T.prim_func
    def kernel(Scores: T.Tensor((S, E), "float32"), Visible: T.Tensor((S,), "int32"), Keys: T.Tensor((S, NB), "int32"),
               Keep: T.Tensor((S, E), "uint8")):
        with P.kernel(S, cfg.threads) as pid:
            st = P.alloc_io((2,), "int64")  # the K-th rank key so far, the one tried
            cnt = P.alloc_io((1,), "float32")
            finite = P.alloc_io((1,), "float32")  # finite blocks; then the ties to keep
            for q in P.tiles(S, pid):
                newest = T.if_then_else(Visible[q] > 0, (Visible[q] - 1) // BS, -1)
                with P.vector(cfg.threads):
                    for i in T.Parallel(1):
                        finite[0] = 0.0
                        st[0] = T.int64(0)
                for c in T.serial(T.ceildiv(NB, BC)):  # block maxima as keys (the newest block +inf); finite ones
                    with P.vector(cfg.threads):
                        vals = P.alloc_reg((BC, BSP), "float32")
                        bmax = P.alloc_reg((BC,), "float32")
                        hit = P.alloc_reg((BC,), "float32")
                        tot = P.alloc_reg((1,), "float32")
                        for i, j in T.Parallel(BC, BSP):
                            p = (c * BC + i) * BS + j
                            vals[i, j] = T.if_then_else(T.And(j < BS, p < E), Scores[q, T.min(p, E - 1)],
                                                        -T.infinity("float32"))
                        T.reduce_max(vals, bmax, dim=1)
                        for i in T.Parallel(BC):
                            kk = T.if_then_else(c * BC + i == newest, POS_INF, key(bmax[i]))
                            if c * BC + i < NB:
                                Keys[q, c * BC + i] = kk
                            hit[i] = T.if_then_else(T.And(c * BC + i < NB, kk > NEG_INF_KEY), 1.0, 0.0)
                        T.reduce_sum(hit, tot, dim=0)  # (its barrier also orders the key stores before any read)
                        for i in T.Parallel(1):
                            finite[0] = finite[0] + tot[0]
                if finite[0] > K:  # else every finite block is kept (st[0] = 0 ranks below them all)
                    for it in T.serial(33 + INDEX_BITS):  # rank keys are below 2^(33 + INDEX_BITS)
                        step(Keys, q, st, cnt, 32 + INDEX_BITS - it)
                for c in T.serial(T.ceildiv(E, BC * BS)):  # the mask of the kept blocks' positions
                    with P.vector(cfg.threads):
                        for i in T.Parallel(BC * BS):
                            if c * BC * BS + i < E:
                                b = (c * BC * BS + i) // BS
                                k = T.cast(Keys[q, T.min(b, NB - 1)], "int64")
                                Keep[q, c * BC * BS + i] = T.if_then_else(
                                    T.And(k > NEG_INF_KEY, rank_key(k, T.cast(b, "int64")) >= st[0]), 1, 0)

    return kernel


KERNEL = Kernel("candidate_blocks", body, configs={"default": Config(), "c": Config(chunk=16, threads=1)})


def variant(topk_blocks: int, block_size: int) -> Variant:
    return Variant(block_size=block_size, topk_blocks=topk_blocks)


def run(launch, scores: torch.Tensor, visible: torch.Tensor, topk_blocks: int, block_size: int) -> torch.Tensor:
    require(scores.dim() == 2 and visible.shape == scores.shape[:1], "candidate_blocks",
            f"scores must be [S, E] and visible [S], got {list(scores.shape)} and {list(visible.shape)}")
    require(1 <= block_size <= 64 and topk_blocks >= 1, "candidate_blocks",
            f"block_size must be 1..64 and topk_blocks >= 1, got {block_size} and {topk_blocks}")
    s, e = scores.shape
    require(-(-e // block_size) < 2**INDEX_BITS, "candidate_blocks",
            f"{e} positions make {-(-e // block_size)} blocks of {block_size}; at most {2**INDEX_BITS - 1} are accepted")
    keep = torch.empty(s, e, dtype=torch.uint8, device=scores.device)
    if s and e:
        keys = torch.empty(s, -(-e // block_size), dtype=torch.int32, device=scores.device)
        launch("candidate_blocks", variant(topk_blocks, block_size))(
            scores.float().contiguous(), visible.to(torch.int32).contiguous(), keys, keep)
    return keep.view(torch.bool)


def example(v: Variant, rows: int, device) -> tuple:
    """Queries at every depth of a causal prefix (the one at 0 sees nothing), distinct scores (no ties at the
    k-th block, where the reference's choice is unspecified), the last positions a ragged block."""
    e = (3 * v.topk_blocks + 1) * v.block_size - 1
    visible = torch.linspace(0, e, rows, device=device).long()
    scores = torch.randn(rows, e, device=device)
    scores = scores.masked_fill(torch.arange(e, device=device).view(1, -1) >= visible.view(-1, 1), float("-inf"))
    return (scores, visible, v.topk_blocks, v.block_size)


OP = OpDecl(
    "candidate_blocks", "candidate-block pre-selection of the two-level top-k", reference,
    kernels=(KERNEL,),
    tolerance={"float32": (0.0, 0.0), "bfloat16": (0.0, 0.0)},  # a mask: exact
    run=run, example=example,
)
