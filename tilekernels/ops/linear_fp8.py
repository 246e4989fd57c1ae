"""The block-scaled FP8 GEMM (W8A8) of `linear` and `grouped_linear` when a checkpoint's weight stays FP8.

C = sum over K blocks b of (A_b @ W_b^T) * sa[m, b] * sw[n / bn, b]: A's codes are quantized per 1 x bk
columns (`act_quant`), W's per bn x bk block (the checkpoint's `weight_block_size`: 128x128 for V4, 32x32 for
V4.1); every K tile is one scale block deep, its product is accumulated in fp32 on its own and promoted into
the running sum with both scales (DeepSeek's fp32 "2xAcc"), so the FP8 products never sum across scales.

Both operands reach the kernels as e4m3 bytes (uint8). The portable body decodes them in its vector region
into the activation dtype (exact: bf16 and fp16 hold every e4m3 value) and runs the target's MMA on those
tiles: it runs everywhere, the CPU `c` target included. The sm90 override views the bytes as float8 and runs
Hopper's FP8 wgmma straight from shared memory. Groups (the grouped output projection) and split K use the
same 3-D views and fp32 workspace as the bf16 GEMM (see `linear`).
"""


from dataclasses import dataclass, field

import torch

from tilekernels import dtypes, fp8
from tilekernels.op import Kernel, Override, require
from tilekernels.ops import split_sum
from tilekernels.quant import BlockQuantized, exponent_bytes, is_exponent_bytes

SCALE_BLOCKS = (32, 64, 128)  # K-block depths a kernel tile takes (one scale block per K tile)


@dataclass(frozen=True)
class Variant:
    n: int  # output features per group
    k: int  # input features per group
    dtype: str  # activations' and output's dtype
    block: tuple[int, int]  # weight scale block (rows, columns); activations use 1 x block[1]
    groups: int = 1
    split_k: int = 1
    narrow: bool = False  # decode-sized rows: 64-row tiles, narrower N tiles
    ue8m0: bool = False  # weight scales are exponent bytes (2^(b-127)); activation scales are powers of two


@dataclass(frozen=True)
class Config:
    block_m: int = 128
    block_n: int = 128
    stages: int = 3
    threads: int = 128
    narrow_threads: int = 128  # 64-row tiles: one warpgroup
    narrow_block_n: int = 64
    min_block_n: int = 16
    full_rows: bool = False  # NVIDIA: warpgroups split the tile by rows (each wgmma block_n wide)
    slices: int = 0  # sm90: >0 selects linear_fp8_sm90's body, the tile's N cut into this many scale-block slices
    ws: bool = False  # sm90: linear_fp8_sm90's explicitly warp-specialised body (two K blocks' wgmmas in flight)
    programs: int = 0  # ws: a persistent grid of this many programs (0: one program per tile)
    chain: int = 4  # ws: K blocks per unrolled chain of overlapped wgmmas (drained between chains)
    cluster: int = 0  # ws: 2 = CTA pairs along N, the shared A tile loaded once and multicast to both
    tma_store: bool = False  # ws: each consumer warpgroup stages its rows in shared memory and stores them by TMA
    short_k: int = 0  # sm90: prefill variants (no split K, one group) with K <= this take `SHORT_K` instead
    pass_configs: dict = field(default_factory=dict, hash=False, compare=False)


def shape(v: Variant, cfg: Config) -> tuple[int, int, int, int, int]:
    """(block_m, block_n, n_tiles, block_k, k_tiles_per_split)."""
    from tilekernels.ops.linear import edge_tile

    require(v.block[1] in SCALE_BLOCKS, "linear", f"FP8 weights need a scale block {SCALE_BLOCKS} columns deep, "
            f"got {v.block[0]}x{v.block[1]}")
    BM = min(cfg.block_m, 64) if v.narrow else cfg.block_m
    tile = cfg.narrow_block_n if v.narrow else cfg.block_n
    if v.groups > 1:  # N tiles must not cross into the next group's outputs: the widest tile dividing N
        fits = [b for b in range(cfg.min_block_n, tile + 1, cfg.min_block_n) if v.n % b == 0]
        require(bool(fits), "linear", f"grouped FP8 GEMM: {v.n} outputs per group is not a multiple of this "
                f"target's {cfg.min_block_n}-wide N tiles")
        BN, NT = fits[-1], v.n // fits[-1]
    else:
        BN, NT = edge_tile(v.n, tile, cfg.min_block_n)
    BK = v.block[1]
    KB = -(-v.k // BK)
    require(KB % v.split_k == 0, "linear", f"K={v.k} in {KB} scale blocks cannot be split {v.split_k} ways")
    return BM, BN, NT, BK, KB // v.split_k


def _geometry(v: Variant, cfg: Config) -> tuple:
    """(BM, BN, N tiles, BK, K tiles per split, K blocks, output dtype, threads) of a variant built with cfg."""
    BM, BN, NT, BK, KT = shape(v, cfg)
    return (BM, BN, NT, BK, KT, -(-v.k // BK), "float32" if v.split_k > 1 else v.dtype,
            cfg.narrow_threads if v.narrow else cfg.threads)


def _signature(T, v: Variant, M):
    """Tensor shapes, groups side by side in 2-D (a group's columns of A / C, rows of W): A codes (M, G*K), A
    scales (M, G*KB), W codes (G*N, K), W scales (G*NB, KB), C ([split,] M, G*N). A group's ragged K edge reads
    the next group's activations against W columns that TileLang zero-fills past K, so it adds nothing; its N
    edge must be a whole tile (`run` checks), or the last tile would store into the next group's outputs."""
    G, N, K, SK = v.groups, v.n, v.k, v.split_k
    KB, NB = -(-K // v.block[1]), -(-(G * N) // v.block[0])
    split = (SK,) if SK > 1 else ()
    return (M, G * K), (M, G * KB), (G * N, K), (NB, KB), split + (M, G * N)


def _scale_dtype(v: Variant) -> str:
    return "uint8" if v.ue8m0 else "float32"


def _weight_scale_raw(T, v: Variant, SW, g, n, kb):
    """The stored scale of group g's weight row n in K block kb (rows past the weight read its last block row;
    a scale block may span two groups' rows, as a checkpoint's [G*N, K] grid lays them out)."""
    nb = -(-(v.groups * v.n) // v.block[0])
    return SW[T.min((g * v.n + n) // v.block[0], nb - 1), kb]


def _scale_value(T, v: Variant, raw):
    """A stored weight scale as fp32 (ue8m0: the exponent byte's power of two)."""
    return fp8.pow2(T, T.cast(raw, "int32") - 127) if v.ue8m0 else raw


def _weight_scale(T, v: Variant, SW, g, n, kb):
    return _scale_value(T, v, _weight_scale_raw(T, v, SW, g, n, kb))


def _tile(t, v: Variant, NT: int, BM: int, BN: int):
    """(split, group, first row, first column) of work tile t: split-minor, then group-minor."""
    SK, G = v.split_k, v.groups
    return t % SK, t // SK % G, t // (SK * NT * G) * BM, (t // (SK * G)) % NT * BN


def body(P, v: Variant, cfg: Config):
    T = P.T
    BM, BN, NT, BK, KT, KB, out_dtype, threads = _geometry(v, cfg)
    G, SK, dtype, K, N = v.groups, v.split_k, v.dtype, v.k, v.n
    M = T.dynamic("M")
    a_shape, sa_shape, w_shape, sw_shape, c_shape = _signature(T, v, M)
    VA, VB = P.vec_rows(BM), P.vec_rows(BN)

    @T.prim_func
    def kernel(A: T.Tensor(a_shape, "uint8"), SA: T.Tensor(sa_shape, "float32"), W: T.Tensor(w_shape, "uint8"),
               SW: T.Tensor(sw_shape, _scale_dtype(v)), C: T.Tensor(c_shape, out_dtype)):
        MT = T.ceildiv(M, BM)
        with P.kernel(MT * NT * G * SK, threads) as pid:
            a_b = P.alloc_io((VA, BK), "uint8")
            w_b = P.alloc_io((VB, BK), "uint8")
            a_d = P.alloc_io((VA, BK), dtype)
            w_d = P.alloc_io((VB, BK), dtype)
            a_op = P.alloc_operand((BM, BK), dtype)
            b_op = P.alloc_operand((BN, BK), dtype)
            acc = P.alloc_acc((BM, BN), "float32")
            part = P.alloc_io((VA, BN), "float32")
            sa_io = P.alloc_io((VA, 1), "float32")
            sw_io = P.alloc_io((BN,), "float32")
            out_io = P.alloc_io((VA, BN), out_dtype)
            total = P.alloc_vec((VA, BN), "float32")
            for t in P.tiles(MT * NT * G * SK, pid):
                ks, g, m0, n0 = _tile(t, v, NT, BM, BN)
                with P.vector(threads):
                    for i, j in T.Parallel(VA, BN):
                        total[i, j] = 0.0
                for kk in T.serial(KT):
                    kb = ks * KT + kk
                    P.split_copy(A[m0:m0 + BM, g * K + kb * BK:g * K + kb * BK + BK], a_b)
                    P.split_copy(W[g * N + n0:g * N + n0 + BN, kb * BK:kb * BK + BK], w_b)
                    P.split_copy(SA[m0:m0 + BM, g * KB + kb:g * KB + kb + 1], sa_io)
                    with P.vector(threads):
                        for i, j in T.Parallel(VA, BK):
                            a_d[i, j] = T.cast(fp8.decode(T, a_b[i, j]), dtype)
                        for i, j in T.Parallel(VB, BK):
                            w_d[i, j] = T.cast(fp8.decode(T, w_b[i, j]), dtype)
                        for j in T.Parallel(BN):
                            sw_io[j] = _weight_scale(T, v, SW, g, n0 + j, kb)
                    P.split_copy(a_d, a_op)
                    P.split_copy(w_d, b_op)
                    P.gemm(a_op, b_op, acc, clear_accum=True)
                    P.split_copy(acc, part)
                    with P.vector(threads):
                        for i, j in T.Parallel(VA, BN):
                            total[i, j] = total[i, j] + part[i, j] * sa_io[i, 0] * sw_io[j]
                with P.vector(threads):
                    for i, j in T.Parallel(VA, BN):
                        out_io[i, j] = T.cast(total[i, j], out_dtype)
                if SK > 1:
                    P.split_copy(out_io, C[ks, m0:m0 + BM, g * N + n0:g * N + n0 + BN])
                else:
                    P.split_copy(out_io, C[m0:m0 + BM, g * N + n0:g * N + n0 + BN])

    return kernel


def body_native(P, v: Variant, cfg: Config):
    """NVIDIA targets with FP8 tensor cores: the byte tensors viewed as e4m3, TMA-fed shared tiles, the FP8 MMA
    (wgmma on sm90; tcgen05 into tensor memory on sm100, read back to registers) into a fresh accumulator per
    scale block, promoted into the fp32 sum with the row and column scales. Configs with `slices` or `ws` take
    the sm90-only (wgmma) variants of `linear_fp8_sm90`."""
    if cfg.slices or cfg.ws:
        from tilekernels.ops import linear_fp8_sm90

        return linear_fp8_sm90.body(P, v, cfg)
    T = P.T
    BM, BN, NT, BK, KT, KB, out_dtype, threads = _geometry(v, cfg)
    G, SK, K, N = v.groups, v.split_k, v.k, v.n
    M = T.dynamic("M")
    a_shape, sa_shape, w_shape, sw_shape, c_shape = _signature(T, v, M)
    e4m3 = "float8_e4m3fn"
    one_scale = v.block[0] % BN == 0 and (v.groups == 1 or N % v.block[0] == 0)  # tiles never straddle scale rows
    in_registers = P.traits.acc != "tmem" or BM not in (64, 128)  # where P.alloc_acc puts the accumulator
    sdt = _scale_dtype(v)

    @T.prim_func
    def kernel(A: T.Tensor(a_shape, "uint8"), SA: T.Tensor(sa_shape, "float32"), W: T.Tensor(w_shape, "uint8"),
               SW: T.Tensor(sw_shape, _scale_dtype(v)), C: T.Tensor(c_shape, out_dtype)):
        MT = T.ceildiv(M, BM)
        with T.Kernel(MT * NT * G * SK, threads=threads) as pid:
            Af = T.view(A, dtype=e4m3)
            Wf = T.view(W, dtype=e4m3)
            a_s = T.alloc_shared((BM, BK), e4m3)
            b_s = T.alloc_shared((BN, BK), e4m3)
            # the scales live in the consumer threads' registers: a shared staging of them is written by the
            # producer stages ahead of the MMA that reads it (measured on the H200: wrong sums, no error)
            sa_s = T.alloc_fragment((BM,), "float32")
            sw_s = T.alloc_fragment((BN,), sdt)  # stored weight scales per column
            ws = T.alloc_local((1,), sdt)  # ... or the tile's one
            acc = P.alloc_acc((BM, BN), "float32")  # fragment (sm90) or tensor memory (sm100)
            part = acc if in_registers else T.alloc_fragment((BM, BN), "float32")
            total = T.alloc_fragment((BM, BN), "float32")
            ks, g, m0, n0 = _tile(pid, v, NT, BM, BN)
            T.clear(total)
            for kk in T.Pipelined(KT, num_stages=cfg.stages):
                kb = ks * KT + kk
                T.copy(Af[m0, g * K + kb * BK], a_s)
                T.copy(Wf[g * N + n0, kb * BK], b_s)
                # the scales are loaded ahead of the MMA and used after it, their latency hidden behind it (their
                # products formed before the MMA measured 3-12 % slower on the H200: benchmarks/tune_fp8.py)
                for i in T.Parallel(BM):
                    sa_s[i] = SA[T.min(m0 + i, M - 1), g * KB + kb]
                if one_scale:
                    ws[0] = _weight_scale_raw(T, v, SW, g, n0, kb)
                else:
                    for j in T.Parallel(BN):
                        sw_s[j] = _weight_scale_raw(T, v, SW, g, n0 + j, kb)
                P.gemm(a_s, b_s, acc, clear_accum=True, full_rows=cfg.full_rows)
                if not in_registers:
                    T.copy(acc, part)
                if one_scale:
                    for i, j in T.Parallel(BM, BN):
                        total[i, j] += part[i, j] * (sa_s[i] * _scale_value(T, v, ws[0]))
                else:
                    for i, j in T.Parallel(BM, BN):
                        total[i, j] += part[i, j] * sa_s[i] * _scale_value(T, v, sw_s[j])
            if SK > 1:
                T.copy(total, C[ks, m0, g * N + n0])
            else:
                T.copy(total, C[m0, g * N + n0])

    return kernel


KERNEL = Kernel("gemm_fp8", body, configs={
    "default": Config(),
    # benchmarks/tune_fp8.py: 128x256 tiles promoted per 128-column slice at prefill rows (decode and split-K
    # variants keep the 128x128 kernel's geometry)
    "sm90": Config(block_m=128, block_n=256, stages=3, threads=256, full_rows=True, slices=2, short_k=4096),
    "sm100": Config(block_m=128, block_n=128, stages=0, threads=128, min_block_n=64, narrow_block_n=64),
    "ascend": Config(block_m=64, block_n=256, stages=0, threads=128, narrow_block_n=256),  # see docs/kernels.md
    "c": Config(block_m=16, block_n=16, stages=0, threads=1, narrow_threads=1, narrow_block_n=16),
}, overrides=(Override("sm90", lambda v: True, body_native), Override("sm100", lambda v: True, body_native)))


def variant(rows: int, n: int, k: int, block: tuple[int, int], ue8m0: bool, groups: int = 1,
            dtype: str = "bfloat16", invariant: bool = False) -> Variant:
    """The FP8 GEMM variant of a call, by the same row buckets as the bf16 GEMM (`linear.variant`): decode
    rows take narrow tiles, and both small buckets split K (whole scale blocks, each slice >= 256 deep) until
    about TARGET_PROGRAMS programs stream the weight. `invariant`: the decode bucket's split at every row count."""
    from tilekernels.ops.linear import ROW_BUCKETS, split_factor

    k_blocks = -(-k // block[1])
    narrow = rows <= ROW_BUCKETS[0]
    if invariant:
        return Variant(n, k, dtype, tuple(block), groups, split_factor(True, n, k, groups, k_blocks), narrow, ue8m0)
    if rows > ROW_BUCKETS[1]:
        return Variant(n, k, dtype, tuple(block), groups, ue8m0=ue8m0)
    return Variant(n, k, dtype, tuple(block), groups, split_factor(narrow, n, k, groups, k_blocks), narrow, ue8m0)


def weight_operands(weight: BlockQuantized) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(e4m3 bytes, scales as the kernel reads them, ue8m0): exponent bytes stay bytes, others become fp32."""
    ue8m0 = is_exponent_bytes(weight.scales)
    scales = exponent_bytes(weight.scales) if ue8m0 else weight.scales.float()
    return weight.values.view(torch.uint8), scales.contiguous(), ue8m0


def gemm(launch, x: torch.Tensor, weight: BlockQuantized, groups: int = 1) -> torch.Tensor:
    """x [M, K] (groups 1) or [M, G, K] against an FP8 weight [G * N, K] -> [M, N] or [M, G, N] in x's dtype:
    the activations are quantized per 1 x block[1] (`act_quant`, powers of two with ue8m0 weights), then the
    block-scaled GEMM. `launch` is the `linear` op's launcher."""
    from tilekernels.ops import act_quant

    require(weight.format == "fp8", "linear", f"a block-quantized linear weight must be FP8, got {weight.format}")
    k = x.shape[-1]
    n = weight.shape[0] // groups
    require(weight.shape[1] == k, "linear", f"x has {k} features, the FP8 weight expects {weight.shape[1]}")
    codes, scales, ue8m0 = weight_operands(weight)
    m = x.shape[0]
    v = variant(m, n, k, weight.block, ue8m0, groups, dtypes.name(x.dtype), getattr(launch, "invariant", False))
    a, sa = act_quant.run(launch.op("act_quant"), x.reshape(-1, k), weight.block[1], ue8m0)
    a, sa = a.view(torch.uint8).view(m, groups * k), sa.view(m, -1)
    out_shape = (m, groups * n)
    if v.split_k == 1:
        y = torch.empty(out_shape, dtype=x.dtype, device=x.device)
        launch("gemm_fp8", v)(a, sa, codes, scales, y)
    else:
        partial = torch.empty((v.split_k, *out_shape), dtype=torch.float32, device=x.device)
        launch("gemm_fp8", v)(a, sa, codes, scales, partial)
        y = split_sum.reduce(launch, partial, x.dtype)
    return y.view(*x.shape[:-1], n)


def emulated(x: torch.Tensor, weight: BlockQuantized, groups: int = 1, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """What the kernels compute, in fp32 PyTorch: x [M, K] (or [M, G, K] with groups) quantized per
    1 x block[1] as `act_quant` does, times the dequantized weight [G * N, K]. The model's reference
    (`linear.reference`) keeps x unquantized; the gap between the two is the activations' FP8 rounding, which the
    tests measure rather than assume. `out_dtype`: the result's dtype (default x's)."""
    from tilekernels.ops import act_quant

    k = x.shape[-1]
    _, _, ue8m0 = weight_operands(weight)
    codes, scales = act_quant.reference(x.reshape(-1, k), weight.block[1], ue8m0)
    xd = (codes.float() * scales.repeat_interleave(weight.block[1], dim=1)[:, :k]).view(*x.shape)
    w = weight.dequantize(torch.float32)
    out = torch.nn.functional.linear(xd, w) if groups == 1 else torch.einsum("mgk,gnk->mgn", xd, w.view(groups, -1, k))
    return out.to(out_dtype or x.dtype)


def example_weight(v: Variant, rows_out: int, device) -> BlockQuantized:
    """A random weight [rows_out, k] with unit-scale outputs, rounded to FP8 with v's block (ue8m0 scales as
    exponent bytes when v.ue8m0), as checkpoints store dense weights."""
    from tilekernels.quant import quantize

    q = quantize(torch.randn(rows_out, v.k, device=device) / v.k**0.5, "fp8", v.block, pow2_scales=v.ue8m0)
    if v.ue8m0:
        q = q.with_exponent_bytes()
    return q
