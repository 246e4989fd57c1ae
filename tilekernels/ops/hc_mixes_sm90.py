"""sm_90a override of the mHC mixing matvec's partials stage (`hc_pre_split`, `hc_mixes_split`) as a tensor-core
GEMM. Same signature and result as the portable split body (`hc_mixes.mixes_body(stage="split")`):
S [M, K] bf16, Fn [MIX, K] fp32 -> Dots [M, SP*MIX] (the part's dot products of each row with Fn's rows) and
Sq [M, SP] (the part's sum of squares of each row), K = N*H, SP = v.split parts over K.

Why (the portable body runs one CTA per (token, part) and streams the part's slice of Fn from L2 for every
token: at 4096 tokens 6 GB of L2 reads for 128 MB of streams): here one CTA takes `block_m` tokens x one part,
so each Fn element read serves 64 rows, and the products run on wgmma. Grid: ceil(M / block_m) x SP CTAs (V4-Flash
at 4096 tokens: 64 x 16; at 1-64 tokens 16 CTAs of one part each, reading up to 128 KB of streams and 96 KB of Fn).

- A operand: the S tile [block_m, block_k] bf16, TMA-copied into shared memory (rows past M and columns past K
  are zero-filled by the copy: they add nothing), `stages` tiles in flight (TileLang's warp-specialised
  pipeline: a producer warpgroup issues the copies, the consumer warpgroup converts Fn and runs the wgmma).
- B operand: Fn is fp32 and the tensor cores take bf16, so each Fn tile [MIX, block_k] is split in shared memory
  into hi = bf16(f) and lo = bf16(f - hi), stacked as one operand [2*MIXP, block_k] (MIXP: MIX rounded up to 8,
  zero rows past MIX): acc[:, o] + acc[:, MIXP + o] = S (hi + lo) = S f to 2^-18 relative per product (the
  streams are exact in bf16, accumulation is fp32). Emulated in fp32 at K = 16384 and 20480: dots within 3e-5
  of float64 (plain fp32: 3e-6; hi alone 1.4e-2), the ops' outputs within 1.2e-5 (tolerance 1e-4).
- The sum of squares on the CUDA cores from the same shared S tile, per thread over `sq_lanes` columns (no
  cross-thread reduction until the end).
- Part p covers K steps [p*SPP, (p+1)*SPP) of block_k columns (SPP = ceil(steps / SP)): another partition of K
  than the portable body's (the finish kernel sums any; steps past K, even whole parts of small shapes, load
  zeros). Batch invariant: a row's sums are over the same columns in the same order whatever the other rows.
"""

from dataclasses import dataclass

from tilekernels.op import require


@dataclass(frozen=True)
class Tune:
    """Tile of the override: `block_m` tokens per CTA (64 per consumer warpgroup of 128 threads), `block_k`
    columns per pipeline step, `stages` S and Fn tiles in flight (the pipeliner also keeps `stages` copies of the
    split operand), `sq_lanes` columns of the per-thread sum of squares state, `min_blocks` CTAs per SM the
    registers must allow (0: no bound; TileLang's default then gives the consumer 240 registers and one CTA fits
    an SM: no other CTA's loads cover one CTA's pipeline fill and drain). Shared memory (`smem_bytes`): 92 KB at
    the defaults and MIX 24, two CTAs per SM."""

    block_m: int = 64
    block_k: int = 64
    stages: int = 4
    threads: int = 128
    sq_lanes: int = 16
    min_blocks: int = 2


TUNE = Tune()


def fits(v) -> bool:
    """The variants this override takes: bf16 streams (fp32 ones keep the portable body) whose rows are whole
    16-byte units (K a multiple of 8: the TMA copies' global strides), in any number of parts."""
    return v.dtype == "bfloat16" and (v.hc * v.hidden) % 8 == 0


def layout(v, tune: Tune = TUNE) -> tuple[int, int, int, int]:
    """(K, MIX, MIXP, SPP): columns, mixes, mixes padded to 8 (wgmma N = 2*MIXP, a multiple of 16), K steps per
    part."""
    K, MIX = v.hc * v.hidden, (2 + v.hc) * v.hc
    steps = -(-K // tune.block_k)
    return K, MIX, -(-MIX // 8) * 8, -(-steps // v.split)


def smem_bytes(v, tune: Tune = TUNE) -> int:
    """Shared memory of one CTA (pipeline tiles, the split operand and the result tile)."""
    _, MIX, MIXP, _ = layout(v, tune)
    bk = tune.block_k
    return tune.stages * bk * (2 * tune.block_m + 4 * MIX + 4 * MIXP) + tune.block_m * 2 * MIXP * 4


def body(P, v, cfg=None, tune: Tune | None = None):
    """The split stage on sm_90a: S [M, K] bf16, Fn [MIX, K] fp32, Dots [M, SP*MIX] fp32, Sq [M, SP] fp32; one CTA
    per (tile of block_m rows, part)."""
    tune = tune or TUNE
    T = P.T
    require(fits(v), "hc_mixes", f"the sm_90a mixes GEMM takes bf16 variants with K a multiple of 8, got {v}")
    require(tune.block_m == 64 * (tune.threads // 128) and tune.threads % 128 == 0 and tune.block_k % 16 == 0
            and tune.block_k % tune.sq_lanes == 0, "hc_mixes", f"bad tile {tune}: 64 rows per warpgroup")
    smem = smem_bytes(v, tune)
    require(smem <= 227 * 1024, "hc_mixes", f"tile {tune} needs {smem} B of shared memory (227 KB per CTA)")
    K, MIX, MIXP, SPP = layout(v, tune)
    SP, BM, BK, SL, dtype = v.split, tune.block_m, tune.block_k, tune.sq_lanes, v.dtype
    NB = 2 * MIXP  # B operand rows: hi, then lo
    F32 = "float32"
    M = T.dynamic("M")

    @T.macro
    def split_fn(f_s, b_s):
        """b_s[o] = bf16(f), b_s[MIXP + o] = bf16(f - bf16(f)) for the tile's Fn rows o < MIX, 0 past them."""
        for o, j in T.Parallel(MIXP, BK):
            f = T.if_then_else(o < MIX, f_s[T.min(o, MIX - 1), j], 0.0)
            hi = T.cast(f, dtype)
            b_s[o, j] = hi
            b_s[MIXP + o, j] = T.cast(f - T.cast(hi, F32), dtype)

    @T.macro
    def add_squares(a_s, sq):
        """sq[i, l] += the squares of row i's columns l, l + SL, ... of the S tile."""
        for i, l in T.Parallel(BM, SL):
            for jj in T.serial(BK // SL):
                x = T.cast(a_s[i, jj * SL + l], F32)
                sq[i, l] = sq[i, l] + x * x

    @T.prim_func
    def kernel(S: T.Tensor((M, K), dtype), Fn: T.Tensor((MIX, K), F32), Dots: T.Tensor((M, SP * MIX), F32),
               Sq: T.Tensor((M, SP), F32)):
        with T.Kernel(T.ceildiv(M, BM), SP, threads=tune.threads) as (bm, part):
            if tune.min_blocks:  # registers capped for that many CTAs: no setmaxnreg reallocation between roles
                T.annotate_min_blocks_per_sm(tune.min_blocks)
                T.disable_warp_group_reg_alloc()
            a_s = T.alloc_shared((BM, BK), dtype)
            f_s = T.alloc_shared((MIX, BK), F32)
            b_s = T.alloc_shared((NB, BK), dtype)
            d_s = T.alloc_shared((BM, NB), F32)
            acc = T.alloc_fragment((BM, NB), F32)
            sq = T.alloc_fragment((BM, SL), F32)
            ss = T.alloc_fragment((BM,), F32)
            m0 = bm * BM
            T.clear(acc)
            T.clear(sq)
            for kk in T.Pipelined(SPP, num_stages=tune.stages):
                k0 = (part * SPP + kk) * BK
                T.copy(S[m0, k0], a_s)
                T.copy(Fn[0, k0], f_s)
                split_fn(f_s, b_s)
                T.gemm(a_s, b_s, acc, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)  # 64 rows a warpgroup
                add_squares(a_s, sq)
            T.reduce_sum(sq, ss, dim=1)
            T.copy(acc, d_s)
            for i, o in T.Parallel(BM, MIX):
                if m0 + i < M:
                    Dots[m0 + i, part * MIX + o] = d_s[i, o] + d_s[i, MIXP + o]
            for i in T.Parallel(BM):
                if m0 + i < M:
                    Sq[m0 + i, part] = ss[i]

    return kernel


def trial_request(op: str, kernel: str, variant):
    """Build request of a tune trial: kernel "<op>_split@<field=value,...>" is this kernel with those Tune fields
    (benchmark sweeps on the H200; module level so that build workers import it), anything else the op's own."""
    from tilekernels.kernels import tune_request

    return tune_request(op, kernel, variant, body, TUNE)
