"""Routed experts: for every (token, slot) run expert `indices[t, s]`'s clipped SwiGLU FFN and add it,
scaled by its routing weight (applied after the down projection), into the token's output.

Kernel path: the (token, slot) rows are gathered by expert into an expert-major layout where each expert's rows
start on a tile boundary (padding rows hold some token's row; their results are never read); a grouped GEMM (each M tile belongs to one expert) computes
gate_up, the SwiGLU kernel activates, a second grouped GEMM computes down, and the weighted rows are added
back per token (`moe_decode`: the layout at decode sizes and the weighted sum are kernels too). FP4 and bf16
experts at decode sizes (up to DECODE_TOKENS tokens) use 16-row tiles; on sm_90a
the bf16 ones run the swapped-operand weight-streaming kernel of `moe_bf16_sm90`, and past DECODE_TOKENS (128-row
tiles) the TMA + wgmma GEMM of `moe_bf16_prefill_sm90`. On sm_90a every
FP4 bf16 variant runs the swapped-operand kernel of `moe_fp4` (weights converted straight into the MMA's
registers; 64-row tiles at prefill sizes; with `moe_fp4.REPACKED`, on the K-permuted layout of `moe_fp4_sm90`,
which the weights then take at load: `kernel_layout`, `BlockQuantized.to`), on sm_100a the block-scaled MMA
kernel of `moe_fp4_sm100` (built, never run); elsewhere the portable body below.

Any N and K: tiles keep their configured sizes and are launched ceil-div; the weight is a 3-D (E, N, K) tensor
and the rows (MT*BM, K) / outputs (MT*BM, N) are 2-D, so every ragged edge is a tensor edge that TileLang
masks (zero-filled loads, unstored outputs), the same way as in `linear`.
"""

from dataclasses import dataclass, field

import torch

from tilekernels import dtypes
from tilekernels.op import Kernel, OpDecl, Override, require
from tilekernels.ops import (
    linear,
    moe_bf16_prefill_sm90,
    moe_bf16_sm90,
    moe_decode,
    moe_fp4,
    moe_fp4_sm90,
    moe_fp4_sm100,
    swiglu,
)
from tilekernels.quant import (
    FP4_BLOCK,
    BlockQuantized,
    dense,
    exponent_bytes,
    is_exponent_bytes,
    quantize,
)


def reference(
    x: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    limit: float,
) -> torch.Tensor:
    """x [N, H], weights/indices [N, k], gate_up [E, 2I, H], down [E, H, I] (plain or block-quantized,
    dequantized one expert at a time) -> [N, H]."""
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
        h = swiglu.reference(torch.nn.functional.linear(x[tok], dense(gate_up[expert], x.dtype)), limit)
        y = torch.nn.functional.linear(h, dense(down[expert], x.dtype)) * slot_weights[start : start + count, None]
        out.index_add_(0, tok, y.to(out.dtype))
        start += count
    return out


@dataclass(frozen=True)
class Variant:
    n: int  # output features
    k: int  # input features
    experts: int
    dtype: str
    block_m: int = 64  # rows per M tile; every expert's rows start on a tile boundary (DECODE_BLOCK_M: decode)
    fp4: bool = False  # weights FP4 e2m1 packed two per byte with one ue8m0 exponent byte per 1x32 block


@dataclass(frozen=True)
class Config:
    block_n: int = 128
    block_k: int = 64
    stages: int = 3
    threads: int = 128
    min_block_n: int = 16  # the narrowest N tile the target's MMA takes with BM rows (sm_100a, 64 rows: 64)
    pass_configs: dict = field(default_factory=dict, hash=False, compare=False)


def body(P, v: Variant, cfg: Config):
    T = P.T
    N, K, E, BM, dtype = v.n, v.k, v.experts, v.block_m, v.dtype
    BN, NT = linear.edge_tile(N, cfg.block_n, cfg.min_block_n)
    BK, KT = linear.edge_tile(K, cfg.block_k)
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


def body_fp4(P, v: Variant, cfg: Config):
    """The grouped GEMM with FP4 weights, converted in the kernel: each K step stages the weight tile's bytes
    and exponents, and a vector region decodes e2m1 * 2^(e - 127) into the operand tile (Hopper has no FP4 MMA;
    the conversion runs beside the activations' tile loads)."""
    T = P.T
    N, K, E, BM, dtype = v.n, v.k, v.experts, v.block_m, v.dtype
    require(K % FP4_BLOCK[1] == 0, "moe_experts", f"FP4 weights need K divisible by {FP4_BLOCK[1]}, got {K}")
    BN, NT = linear.edge_tile(N, cfg.block_n, cfg.min_block_n)
    BK = max(FP4_BLOCK[1], cfg.block_k // FP4_BLOCK[1] * FP4_BLOCK[1])
    KT = -(-K // BK)
    KP, KS = K // 2, K // FP4_BLOCK[1]
    MT = T.dynamic("MT")
    threads = cfg.threads

    @T.prim_func
    def kernel(A: T.Tensor((MT * BM, K), dtype), W: T.Tensor((E, N, KP), "uint8"), S: T.Tensor((E, N, KS), "uint8"),
               TileExpert: T.Tensor((MT,), "int32"), C: T.Tensor((MT * BM, N), dtype)):
        with P.kernel(MT * NT, threads) as pid:
            a_op = P.alloc_operand((BM, BK), dtype)
            b_op = P.alloc_operand((BN, BK), dtype)
            w_io = P.alloc_io((BN, BK // 2), "uint8")
            s_io = P.alloc_io((BN, BK // FP4_BLOCK[1]), "uint8")
            acc = P.alloc_acc((BM, BN), "float32")
            for t in P.tiles(MT * NT, pid):
                m0 = t // NT * BM
                n0 = t % NT * BN
                if TileExpert[t // NT] >= 0:
                    for kk in T.serial(KT):
                        T.copy(A[m0, kk * BK], a_op)
                        T.copy(W[TileExpert[t // NT], n0, kk * (BK // 2)], w_io)
                        T.copy(S[TileExpert[t // NT], n0, kk * (BK // FP4_BLOCK[1])], s_io)
                        with P.vector(threads):
                            for i, j in T.Parallel(BN, BK):
                                byte = T.cast(w_io[i, j // 2], "int32")  # bound on its own: Ascend lowers it so
                                nib = T.shift_right(byte, (j % 2) * 4) & 15
                                ex = T.shift_right(nib, 1) & 3
                                frac = 1.0 + T.cast(nib & 1, "float32") * 0.5
                                mag = T.if_then_else(ex == 0, frac - 1.0, T.exp2(T.cast(ex - 1, "float32")) * frac)
                                scale = T.exp2(T.cast(T.cast(s_io[i, j // FP4_BLOCK[1]], "int32") - 127, "float32"))
                                val = T.if_then_else(nib >= 8, -mag, mag) * scale
                                b_op[i, j] = T.cast(T.if_then_else(kk * BK + j < K, val, 0.0), dtype)
                        P.gemm(a_op, b_op, acc, clear_accum=kk == 0)
                    P.store_acc(acc, C[m0, n0])

    return kernel


_CPU = Config(block_n=16, block_k=16, stages=0, threads=1)
# bf16 variants on sm_90a: the swapped-operand kernel of moe_fp4 (its tiles are moe_fp4.TUNE / PREFILL_TUNE, the
# pass configs below theirs, harmless for the portable body, which has no pipelined loop); on sm_100a (K a
# multiple of 128) the block-scaled MMA kernel of moe_fp4_sm100, never run (no Blackwell GPU here).
KERNEL_FP4 = Kernel("grouped_gemm_fp4", body_fp4, overrides=(
    Override("sm90", lambda v: v.dtype == "bfloat16", lambda P, v, cfg: moe_fp4.body_decode(P, v, cfg)),
    Override("sm100", moe_fp4_sm100.fits, moe_fp4_sm100.body),
), configs={
    "default": Config(block_n=128, block_k=64, stages=0, threads=128),
    "sm90": Config(block_n=128, block_k=64, stages=0, threads=128, pass_configs=moe_fp4.TUNE.pass_configs),
    "sm100": Config(block_n=128, block_k=64, stages=0, threads=128, min_block_n=64,
                    pass_configs=moe_fp4_sm100.PASS_CONFIGS),
    "ascend": Config(block_n=128, block_k=64, stages=0, threads=128),
    "c": Config(block_n=16, block_k=32, stages=0, threads=1),
})
# Routed FP4 experts in the K-permuted layout (`moe_fp4.REPACKED`): one kernel per decoder ("kperm": any exponent,
# "kperm1": exponent bytes <= 128), the decode and the 64-row tiles of `moe_fp4.kperm_tune`. A target whose
# kernel has the K-permuted body reads the layout (and repacks at load: `kernel_layout`); on the others these names
# build what grouped_gemm_fp4 builds there (the compile plan lists them; never launched: the weights stay plain).


def _fits_kperm(v: Variant) -> bool:
    return v.dtype == "bfloat16" and v.n % 64 == 0 and v.k % moe_fp4.KPERM_BLOCK_K == 0


def _kperm_body(decode: str):
    return lambda P, v, cfg: moe_fp4_sm90.body(P, v, cfg, moe_fp4.kperm_tune(v.block_m, decode))


KPERM_BODIES = {d: _kperm_body(d) for d in moe_fp4.KPERM}
KERNELS_KPERM = {d: Kernel(f"grouped_gemm_fp4_{d}", body_fp4, overrides=(
    Override("sm90", _fits_kperm, KPERM_BODIES[d]), *KERNEL_FP4.overrides), configs=KERNEL_FP4.configs)
    for d in moe_fp4.KPERM}
# bf16 on sm_90a: decode variants (16-row tiles) run the swapped-operand weight-streaming kernel of moe_bf16_sm90,
# prefill variants (64 / 128-row tiles) the TMA + wgmma GEMM of moe_bf16_prefill_sm90 (both TileLang's default
# warp-specialised pipeline: no pass config); every other target and variant (fp32): the portable body.
KERNEL = Kernel("grouped_gemm", body, overrides=(
    Override("sm90", moe_bf16_sm90.fits, moe_bf16_sm90.body_decode),
    Override("sm90", moe_bf16_prefill_sm90.fits, moe_bf16_prefill_sm90.body),
), configs={
    "default": Config(),
    "sm100": Config(block_n=128, block_k=64, stages=3, threads=128, min_block_n=64),
    "ascend": Config(block_n=128, block_k=64, stages=2, threads=0),
    "c": _CPU,
})
BLOCK_M = 64  # fp32 experts (and FP4 ones past DECODE_TOKENS): rows per M tile
PREFILL_BLOCK_M = 128  # bf16 experts past DECODE_TOKENS: rows per M tile (sm_90a: moe_bf16_prefill_sm90, measured)
DECODE_BLOCK_M = 16  # FP4 and bf16 experts at decode: rows per tile (wgmma N on sm_90a; the portable body's MMA M)
DECODE_TOKENS = 64  # up to this many tokens the FP4 and bf16 experts run their decode variants


def layout(indices: torch.Tensor, experts: int, bm: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert-major padded layout without a host sync (CUDA-graph safe): the destination row of every
    (token, slot) in flat order, and the expert of each M tile (-1 past the last expert's rows). Each expert's
    rows start on a tile boundary, in flat order within the expert; the tile count is the static bound
    `moe_decode.tile_bound`. Above DECODE_TOKENS tokens `run` takes it (a stable sort); at decode sizes the
    `moe_route` kernel computes the same result (this is its reference: tests/tilekernels/test_moe_decode.py)."""
    flat = indices.reshape(-1)
    n_tiles = moe_decode.tile_bound(flat.numel(), experts, bm)
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
    tile_start = torch.arange(n_tiles, device=flat.device) * bm
    expert = torch.searchsorted(ends, tile_start, right=True)
    tiles = torch.where(expert < experts, expert, torch.full_like(expert, -1)).to(torch.int32)
    return dest, tiles


def variant(n: int, k: int, experts: int, dtype: str, fp4: bool = False, tokens: int | None = None) -> Variant:
    """The variant of one expert GEMM (n output features, k input features): gate_up is
    variant(2I, H, E, dtype), down is variant(H, I, E, dtype). FP4 weights (any activation dtype) and bf16
    weights at up to DECODE_TOKENS tokens get the decode tile (a few rows per expert: DECODE_BLOCK_M-row tiles;
    the same variant on every target: sm_90a runs its decode override, the others the portable body with 16-row
    tiles); past them bf16 experts take PREFILL_BLOCK_M-row tiles (sm_90a: moe_bf16_prefill_sm90), FP4 and fp32
    ones BLOCK_M."""
    decode = (fp4 or dtype == "bfloat16") and tokens is not None and tokens <= DECODE_TOKENS
    if decode:
        return Variant(n, k, experts, dtype, DECODE_BLOCK_M, fp4)
    return Variant(n, k, experts, dtype, PREFILL_BLOCK_M if dtype == "bfloat16" and not fp4 else BLOCK_M, fp4)


def _describe(w) -> str:
    return f"{w.format} {w.block[0]}x{w.block[1]}" if isinstance(w, BlockQuantized) else str(w.dtype)


def _operands(w) -> tuple:
    """A plain weight, or FP4 bytes and their ue8m0 exponent bytes (as uint8); K-permuted FP4 as int32 words."""
    if not isinstance(w, BlockQuantized):
        return (w.contiguous(),)
    if w.layout != "plain":
        return w.values.contiguous(), w.scales.contiguous().view(torch.int32)
    scales = exponent_bytes(w.scales)  # a view: loading converts fp32 power-of-two scales to bytes once
    return w.values.contiguous(), scales.contiguous()


def _fp4_kernel(w: BlockQuantized) -> str:
    return "grouped_gemm_fp4" if w.layout == "plain" else KERNELS_KPERM[w.layout].name


def kperm_fits(w) -> bool:
    """Whether `w` is a stack of FP4 experts [E, N, K] (exponent-byte scales) that the K-permuted layout can hold."""
    return (isinstance(w, BlockQuantized) and w.format == "fp4" and w.block == FP4_BLOCK and w.dim() == 3
            and w.layout == "plain" and is_exponent_bytes(w.scales) and w.shape[1] % 64 == 0
            and w.shape[2] % moe_fp4.KPERM_BLOCK_K == 0)


def reads_kperm(target, n: int, k: int, experts: int) -> bool:
    """Whether `target`'s FP4 expert kernels read the K-permuted layout: its `grouped_gemm_fp4_kperm*` kernels
    have an override for bf16 activations at this shape (a fact of the op's override table, not of a name)."""
    v = Variant(n, k, experts, "bfloat16", DECODE_BLOCK_M, True)
    return all(KERNELS_KPERM[d].body_for(target.name, v) is KPERM_BODIES[d] for d in moe_fp4.KPERM)


def kernel_layout(w, target):
    """`w` as `target`'s kernels take it: with `moe_fp4.REPACKED`, a stack of FP4 experts that fits, on a target
    that reads the K-permuted layout, is repacked (once: "kperm1" when every exponent byte is <= 128, else "kperm");
    anything else is returned as it is."""
    if not (moe_fp4.REPACKED and kperm_fits(w) and not w.values.is_meta
            and reads_kperm(target, w.shape[1], w.shape[2], w.shape[0])):
        return w
    exact = int(w.scales.view(torch.uint8).max()) > 128
    decode = "kperm" if exact else "kperm1"
    values, scales = moe_fp4_sm90.repack(w.values, w.scales.view(torch.uint8), moe_fp4.kperm_tune(BLOCK_M, decode))
    # the decoder rides on the scales' dtype (int32 words: "kperm1", their bytes: "kperm"), so any copy of the
    # tensors (expert parallelism's rows and gathers included) keeps the layout
    return BlockQuantized(values, scales if not exact else scales.view(torch.uint8), w.block, w.format)


def run(launch, x, weights, indices, gate_up, down, limit):
    """Meta-tensor safe: no host reads of tensor values (the layout's tile count is a static bound)."""
    n_tok, hidden = x.shape
    experts, two_i, _ = gate_up.shape
    inter = two_i // 2
    require(gate_up.shape[2] == hidden and tuple(down.shape) == (experts, hidden, inter), "moe_experts",
            f"gate_up must be [E, 2I, {hidden}] and down [E, {hidden}, I]; got {list(gate_up.shape)}, {list(down.shape)}")
    fp4 = isinstance(gate_up, BlockQuantized)
    if fp4 or isinstance(down, BlockQuantized):
        for w in (gate_up, down):
            require(isinstance(w, BlockQuantized) and w.format == "fp4" and w.block == FP4_BLOCK, "moe_experts",
                    f"quantized experts must both be FP4 with 1x32 scales, got {_describe(w)}")
    else:
        require(x.dtype == gate_up.dtype == down.dtype, "moe_experts", f"x, gate_up, down dtypes differ: "
                f"{x.dtype}, {gate_up.dtype}, {down.dtype}")
    dtype = dtypes.name(x.dtype)
    up_v = variant(two_i, hidden, experts, dtype, fp4, n_tok)
    down_v = variant(hidden, inter, experts, dtype, fp4, n_tok)
    up_kernel, down_kernel = (_fp4_kernel(gate_up), _fp4_kernel(down)) if fp4 else ("grouped_gemm", "grouped_gemm")
    if fp4 and moe_fp4.REPACKED and gate_up.values.is_meta and gate_up.layout == "plain":  # the compile plan's trace
        for w, v in ((gate_up, up_v), (down, down_v)):  # what a target that repacks these weights at load launches
            if kperm_fits(w):
                launch(KERNELS_KPERM["kperm1"].name, v)
    top_k = indices.shape[1]
    if n_tok == 0:  # no rows: no launch (an empty grid is not a launch on a GPU)
        return torch.zeros_like(x)
    if n_tok <= DECODE_TOKENS:  # one kernel instead of ~15 small PyTorch ones (moe_decode)
        dest, tiles = moe_decode.route(launch, indices, experts, up_v.block_m, DECODE_TOKENS * top_k)
        # a few rows: one scatter kernel (padding rows are never read)
        rows = torch.empty(tiles.numel() * up_v.block_m, hidden, dtype=x.dtype, device=x.device)
        rows[dest.view(n_tok, top_k)] = x[:, None].expand(n_tok, top_k, hidden)
    else:
        dest, tiles = layout(indices, experts, up_v.block_m)
        # each layout row's token (padding rows read token 0; never read back), then one row gather: index_select
        # runs near the copy bandwidth, the scatter above 4x slower at prefill sizes (2 ms a layer at 16K tokens)
        src = torch.zeros(tiles.numel() * up_v.block_m, dtype=torch.long, device=x.device)
        src[dest] = torch.arange(n_tok * top_k, device=x.device) // top_k
        rows = x.index_select(0, src)
    total = rows.shape[0]
    h = torch.empty(total, two_i, dtype=x.dtype, device=x.device)
    launch(up_kernel, up_v)(rows, *_operands(gate_up), tiles, h)
    a = swiglu.run(launch.op("swiglu"), h, limit)
    y = torch.empty(total, hidden, dtype=x.dtype, device=x.device)
    launch(down_kernel, down_v)(a, *_operands(down), tiles, y)
    # each token's k rows weighted in fp32 and summed in slot order (deterministic: no atomics)
    return moe_decode.combine(launch, y, dest, weights, dtype)


def example(v: Variant, rows: int, device) -> tuple:
    """Reference args for a token batch of `rows` on a layer with v.experts experts (v.n = 2I, v.k = H; the
    down variant (H, I) is the same layer read the other way round, so both give the layer's args). Routing
    is random top-k over min(6, E/2) experts: per-expert row counts are ragged and some experts get none."""
    dtype = dtypes.torch_dtype(v.dtype)
    if v.n % 2 == 0:
        inter, hidden = v.n // 2, v.k
    else:  # only a down variant can have an odd n (= H)
        inter, hidden = v.k, v.n
    top_k = max(1, min(6, v.experts // 2))
    x = torch.randn(rows, hidden, device=device).to(dtype)
    scores = torch.rand(rows, v.experts, device=device)
    indices = scores.topk(top_k, dim=-1).indices
    weights = torch.softmax(torch.randn(rows, top_k, device=device), -1)
    gate_up = (torch.randn(v.experts, 2 * inter, hidden, device=device) / hidden**0.5).to(dtype)
    down = (torch.randn(v.experts, hidden, inter, device=device) / inter**0.5).to(dtype)
    if v.fp4:  # the same weights rounded to FP4 with ue8m0 scales (exponent bytes), as checkpoints store experts
        gate_up, down = quantize(gate_up, "fp4").with_exponent_bytes(), quantize(down, "fp4").with_exponent_bytes()
    return (x, weights, indices, gate_up, down, 10.0)


OP = OpDecl(
    "moe_experts", "grouped expert GEMMs (gate_up, clipped SwiGLU, down) with weighted combine", reference,
    kernels=(KERNEL, KERNEL_FP4, *KERNELS_KPERM.values(), moe_decode.ROUTE, moe_decode.COMBINE),
    tolerance={"float32": (1e-4, 1e-4), "bfloat16": (3e-2, 3e-2)},
    run=run, example=example, uses=("swiglu",), row_samples=(DECODE_TOKENS + 1,),
)
