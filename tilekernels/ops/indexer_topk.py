"""Lightning-indexer selection: the top-k visible compressed entries per query; -1 marks an empty pick.

Equal scores are taken lowest entry first, so a query's picks do not depend on how many entries lie past what it
can see (a prefill's chunking, a batch's padding): V4.1's FP4-rounded index queries and keys with few heads score
exact ties (all-negative dot products give 0 after the ReLU).

The kernel (one CTA per query row) gives exactly the reference's picks in the reference's order (scores
descending, equal scores lowest entry first), without sorting the row:

- Keys. Each visible score becomes an order-preserving 32-bit key (-0.0 as +0.0, which the sort holds equal).
  Entries past `visible` are never candidates: when a row sees at most k entries it takes them all.
- Radix select. The k-th largest key is found digit by digit, 8 bits a pass from the highest bit in which the
  row's smallest and largest keys differ (so the first pass spreads the row over up to 256 bins, not the few
  its exponent bytes fill), counting each candidate in a shared histogram with integer atomics; a pass ends the
  search once the boundary bin holds exactly the picks still needed. Only exact ties at the boundary run four more
  passes over the entry numbers, for the lowest ones.
- The k picks (unordered: atomic slots) are then sorted in shared memory by a bitonic network on unique 64-bit
  (key, reversed entry) pairs, which is the reference's order, and written with -1 for entries past `visible`.

Counts are integer sums and the sort's keys are unique, so the result never depends on the atomics' order: it is
bit-identical to the reference and batch invariant. Scores are staged in shared memory `tile` entries at a time
(once for rows up to `tile` entries; re-read from L2 each pass past it)."""

from dataclasses import dataclass

import torch

from tilekernels.op import Kernel, OpDecl, require

RADIX = 256  # bins of a pass (8 bits)
MIN_SLOTS = 16  # every k up to 16 (the test models') shares one kernel


def top_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The indices of the k largest entries along the last dim, ties broken toward the lower index."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]


def reference(scores: torch.Tensor, visible: torch.Tensor, k: int) -> torch.Tensor:
    """scores [S, E] fp32, visible [S] int (entries e < visible[s] are causal) -> indices [S, min(k, E)] int64."""
    n_entries = scores.shape[-1]
    kk = min(k, n_entries)
    entry = torch.arange(n_entries, device=scores.device)
    future = entry.view(1, -1) >= visible.view(-1, 1)
    picks = top_indices(scores.masked_fill(future, float("-inf")), kk)
    return torch.where(picks >= visible.view(-1, 1), torch.full_like(picks, -1), picks)


@dataclass(frozen=True)
class Variant:
    slots: int  # picks a row can hold (a power of two >= k, at least MIN_SLOTS: the bitonic network's width)


@dataclass(frozen=True)
class Config:
    threads: int = 512
    tile: int = 16384  # scores staged in shared memory at a time (64 KB): a 64K context at rate 4 in one copy


def pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def body(P, v: Variant, cfg: Config):
    T = P.T
    TH, TILE, KP = cfg.threads, cfg.tile, v.slots
    require(TH & (TH - 1) == 0 and TILE % TH == 0 and (TH == 1 or TH >= RADIX), "indexer_topk",
            f"threads {TH} must be a power of two dividing the tile {TILE}, 1 or at least {RADIX}")
    require(KP >= MIN_SLOTS and KP & (KP - 1) == 0, "indexer_topk",
            f"slots must be a power of two >= {MIN_SLOTS}, got {KP}")
    M, E, KK = T.dynamic("M"), T.dynamic("E"), T.dynamic("KK")
    U32, U64, I32 = "uint32", "uint64", "int32"
    LOG_TH, LOG_KP, CHUNK = TH.bit_length() - 1, KP.bit_length() - 1, min(TILE, 8192)
    # st (int32): visible entries, picks still needed, the boundary bin, candidates above it, pick slots used, the
    # search's stage (0 keys, 1 entries of tied keys, 2 done), the top differing key bit
    NVIS, NEED, BIN, ABOVE, SLOTS, STAGE, HB = range(7)
    # ust (uint32): per stage a prefix and mask of the boundary's bits found so far
    ONE = T.uint32(1)

    def key(x):
        """Order-preserving uint32 of fp32 x (-0.0 -> +0.0: the sort holds them equal): negative floats' bits
        inverted, the others' sign bit set."""
        b = T.if_then_else(x == T.float32(0), T.uint32(0), T.reinterpret(x, U32))
        return b ^ ((b >> T.uint32(31)) * T.uint32(0x7FFFFFFF) | T.uint32(0x80000000))

    def reversed_entry(e):
        return T.uint32(0xFFFFFFFF) - T.cast(e, U32)

    @T.macro
    def stage(S, s_io, row, t0, n):
        """The row's scores [t0, t0 + n) (n <= TILE) into s_io, in copies of CHUNK entries."""
        for c in T.serial(T.ceildiv(n, CHUNK)):
            T.copy(S[row, t0 + c * CHUNK : t0 + (c + 1) * CHUNK], s_io[c * CHUNK : (c + 1) * CHUNK])

    @T.macro
    def each_visible(S, s_io, st, row, nvis, tiles, visit, bufs):
        """visit(t, e, key, bufs) for each visible entry e of the row (thread t's); rows past one tile staged a
        tile at a time."""
        for tt in T.serial(tiles):
            if tiles > 1:
                stage(S, s_io, row, tt * TILE, T.min(nvis - tt * TILE, TILE))
            with P.vector(TH):
                for t in T.Parallel(TH):
                    for s in T.serial(T.ceildiv(T.min(nvis - tt * TILE, TILE), TH)):
                        e = tt * TILE + s * TH + t
                        if e < st[NVIS]:
                            visit(t, e, key(s_io[s * TH + t]), bufs)

    # visitors of `each_visible` (thread t, entry e, its key u): the row's key range, a pass's counts, the picks
    @T.macro
    def min_max(t, e, u, bufs):
        kmin, kmax = bufs
        kmin[t] = T.min(kmin[t], u)
        kmax[t] = T.max(kmax[t], u)

    @T.macro
    def bin_count(t, e, u, bufs):
        hist, ust, tie, lo, wmask = bufs
        x = reversed_entry(e) if tie else u
        ok = u == ust[0] if tie else True
        if ok and x & ust[2 * tie + 1] == ust[2 * tie]:
            T.atomic_add(hist[T.cast((x >> lo) & wmask, I32)], 1)

    @T.macro
    def gather(t, e, u, bufs):
        picks, st, ust = bufs
        if u & ust[1] > ust[0] or u & ust[1] == ust[0] and reversed_entry(e) & ust[3] >= ust[2]:
            slot = T.atomic_add(st[SLOTS], 1, return_prev=True)
            picks[slot] = (T.cast(u, U64) << T.uint64(32)) | T.cast(reversed_entry(e), U64)

    @T.macro
    def count(S, s_io, hist, st, ust, row, nvis, tiles, tie, lo, wmask):
        """hist[bin] += 1 for each candidate: the visible entries whose key (stage 0) or reversed entry among
        the tied keys (stage 1) matches the boundary's bits found so far; its bin: bits lo.. (wmask) of it."""
        with P.vector(TH):
            for d in T.Parallel(RADIX):
                hist[d] = 0
        each_visible(S, s_io, st, row, nvis, tiles, bin_count, (hist, ust, tie, lo, wmask))

    @T.macro
    def choose(hist, suf, st, ust, tie, lo, wmask):
        """The bin holding the st[NEED]-th largest candidate: its bits join the prefix, the candidates above it
        leave the need; the stage ends when that bin holds exactly the picks still needed."""
        with P.vector(TH):
            for d in T.Parallel(RADIX):
                suf[0, d] = hist[d]
        for step in T.serial(8):  # suffix sums, Hillis-Steele: suf[..] = hist[d] + ... + hist[RADIX - 1]
            with P.vector(TH):
                for d in T.Parallel(RADIX):
                    up = T.min(d + (1 << step), RADIX - 1)
                    suf[(step + 1) % 2, d] = suf[step % 2, d] + T.if_then_else(d + (1 << step) < RADIX,
                                                                              suf[step % 2, up], 0)
        with P.vector(TH):
            for d in T.Parallel(RADIX):
                above = T.if_then_else(d + 1 < RADIX, suf[0, T.min(d + 1, RADIX - 1)], 0)
                if suf[0, d] >= st[NEED] and above < st[NEED]:
                    st[BIN] = d
                    st[ABOVE] = above
        with P.vector(TH):
            for _ in T.Parallel(1):
                ust[2 * tie] = ust[2 * tie] | (T.cast(st[BIN], U32) << lo)
                ust[2 * tie + 1] = ust[2 * tie + 1] | (wmask << lo)
                st[NEED] = st[NEED] - st[ABOVE]
                if hist[st[BIN]] == st[NEED]:
                    st[STAGE] = 2
                elif ust[2 * tie + 1] == T.uint32(0xFFFFFFFF):  # every key bit found: exact ties, by entry
                    st[STAGE] = 1

    @T.prim_func
    def kernel(S: T.Tensor((M, E), "float32"), Visible: T.Tensor((M,), "int64"), Out: T.Tensor((M, KK), "int64")):
        with P.kernel(M, TH) as pid:
            s_io = P.alloc_io((TILE,), "float32")
            hist = P.alloc_io((RADIX,), I32)
            suf = P.alloc_io((2, RADIX), I32)
            red = P.alloc_io((2, 2, TH), U32)  # min / max partials, two buffers
            st = P.alloc_io((8,), I32)
            ust = P.alloc_io((4,), U32)
            picks = P.alloc_io((KP,), U64)
            kmin = P.alloc_vec((TH,), U32)
            kmax = P.alloc_vec((TH,), U32)
            tiles = T.ceildiv(E, TILE)
            for row in P.tiles(M, pid):
                nvis = T.min(T.cast(Visible[row], I32), E)  # loop extents read it here, not from shared memory
                with P.vector(TH):
                    for _ in T.Parallel(1):
                        st[NVIS] = T.min(T.cast(Visible[row], I32), E)
                        st[NEED] = KK
                        st[SLOTS] = 0
                        st[STAGE] = T.if_then_else(T.min(T.cast(Visible[row], I32), E) > KK, 0, 2)
                        st[HB] = -1
                        for i in T.serial(4):  # no bits found: in stage 2 from the start every visible entry is a pick
                            ust[i] = T.uint32(0)
                    for t in T.Parallel(TH):
                        kmin[t] = T.uint32(0xFFFFFFFF)
                        kmax[t] = T.uint32(0)
                    for i in T.Parallel(KP):
                        picks[i] = T.uint64(0)  # below every pick: sorted last, written as -1
                if tiles == 1:
                    stage(S, s_io, row, 0, nvis)
                if st[STAGE] == 0:
                    # the row's smallest and largest visible keys: the bits above their top differing one are the
                    # same in every candidate
                    each_visible(S, s_io, st, row, nvis, tiles, min_max, (kmin, kmax))
                    with P.vector(TH):
                        for t in T.Parallel(TH):
                            red[0, 0, t] = kmin[t]
                            red[1, 0, t] = kmax[t]
                    for step in T.serial(LOG_TH):
                        with P.vector(TH):
                            for t in T.Parallel(TH):
                                o = T.min(t + (1 << step), TH - 1)
                                red[0, (step + 1) % 2, t] = T.min(red[0, step % 2, t], red[0, step % 2, o])
                                red[1, (step + 1) % 2, t] = T.max(red[1, step % 2, t], red[1, step % 2, o])
                    with P.vector(TH):
                        for _ in T.Parallel(1):
                            diff = red[0, LOG_TH % 2, 0] ^ red[1, LOG_TH % 2, 0]
                            for b in T.serial(32):
                                if (diff >> T.cast(b, U32)) & ONE == ONE:
                                    st[HB] = b
                            if st[HB] < 0:  # every visible key equal: ties only
                                ust[0] = red[1, LOG_TH % 2, 0]
                                ust[1] = T.uint32(0xFFFFFFFF)
                                st[STAGE] = 1
                            else:
                                ust[1] = T.if_then_else(st[HB] == 31, T.uint32(0),
                                                        ~((T.uint32(2) << T.cast(T.max(st[HB], 0), U32)) - ONE))
                                ust[0] = red[1, LOG_TH % 2, 0] & ust[1]
                # key passes, from the top differing bit down
                for p in T.serial(4):
                    if st[STAGE] == 0:
                        # bits [lo, hi] of the keys: the 8 below those found (the last pass: those left)
                        lo = T.cast(T.max(st[HB] - 7 - 8 * p, 0), U32)
                        wmask = (ONE << T.cast(T.min(st[HB] - 8 * p + 1, 8), U32)) - ONE
                        count(S, s_io, hist, st, ust, row, nvis, tiles, 0, lo, wmask)
                        choose(hist, suf, st, ust, 0, lo, wmask)
                # tied keys: the lowest entries, by their reversed numbers, 8 bits a pass
                for p in T.serial(4):
                    if st[STAGE] == 1:
                        lo = T.cast(24 - 8 * p, U32)
                        count(S, s_io, hist, st, ust, row, nvis, tiles, 1, lo, T.uint32(255))
                        choose(hist, suf, st, ust, 1, lo, T.uint32(255))
                # the picks, in slots taken in any order: above the boundary, or at it
                each_visible(S, s_io, st, row, nvis, tiles, gather, (picks, st, ust))
                # bitonic network, descending: (key, reversed entry) pairs are unique, so this is the stable order
                for run in T.serial(LOG_KP):  # runs of 2 << run sorted, alternating, by strides 1 << (run - j)
                    for j in T.serial(run + 1):
                        with P.vector(TH):
                            for i in T.Parallel(KP // 2):
                                sl = run - j
                                lo = ((i >> sl) << (sl + 1)) | (i & ((1 << sl) - 1))
                                hi = lo + (1 << sl)
                                a, b = picks[lo], picks[hi]
                                # both stores unconditional: no branch for the condition solver, no divergence
                                keep = T.if_then_else((lo >> (run + 1)) & 1 == 0, a >= b, a <= b)
                                picks[lo] = T.if_then_else(keep, a, b)
                                picks[hi] = T.if_then_else(keep, b, a)
                with P.vector(TH):
                    for i in T.Parallel(KP):
                        if i < KK:
                            e = T.cast(T.uint32(0xFFFFFFFF) - T.cast(picks[i] & T.uint64(0xFFFFFFFF), U32), "int64")
                            Out[row, i] = T.if_then_else(e < T.cast(st[NVIS], "int64"), e, T.int64(-1))

    return kernel


KERNEL = Kernel("indexer_topk", body, configs={"default": Config(), "c": Config(threads=1, tile=64)})


def variant(scores: torch.Tensor, visible: torch.Tensor, k: int) -> Variant:
    """The kernel variant `run` launches for these inputs (no tensor values are read: meta tensors work)."""
    return Variant(slots=max(MIN_SLOTS, pow2_at_least(int(k))))


def run(launch, scores: torch.Tensor, visible: torch.Tensor, k: int) -> torch.Tensor:
    require(scores.dim() == 2 and scores.dtype == torch.float32, "indexer_topk",
            f"scores must be fp32 [rows, entries], got {scores.dtype} {list(scores.shape)}")
    m, e = scores.shape
    require(visible.shape == (m,) and not visible.is_floating_point(), "indexer_topk",
            f"visible must be integer [{m}], got {visible.dtype} {list(visible.shape)}")
    require(k >= 1, "indexer_topk", f"k must be at least 1, got {k}")
    out = torch.empty(m, min(k, e), dtype=torch.int64, device=scores.device)
    if m and e:
        launch("indexer_topk", variant(scores, visible, k))(scores.contiguous(), visible.long().contiguous(), out)
    return out


def example(v: Variant, rows: int, device, entries: int | None = None, k: int | None = None) -> tuple:
    """(scores, visible, k) for `rows` queries over `entries` (default 4 * slots + 100) with k = slots (or `k`):
    scores with exact ties (rounded to 0.1: runs of equal keys at the boundary), and rows that see all the
    entries, fewer than k, k + 1 and any number of them."""
    k = v.slots if k is None else k
    entries = 4 * v.slots + 100 if entries is None else entries
    scores = torch.randn(rows, entries, device=device).round(decimals=1)
    visible = torch.randint(0, entries + 1, (rows,), device=device)
    first = [entries, k // 2, k + 1][: min(rows, 3)]
    visible[: len(first)] = torch.tensor(first, device=device)
    return scores, visible, k


OP = OpDecl("indexer_topk", "masked top-k of the indexer scores (radix select, then a sort of the picks)",
            reference, kernels=(KERNEL,), tolerance={"float32": (0, 0), "bfloat16": (0, 0)}, run=run, example=example)
