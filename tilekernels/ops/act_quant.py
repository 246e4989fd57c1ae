"""Per-token-group activation quantization to FP8 e4m3, as DeepSeek's `act_quant`: every row is cut into
groups of `group` columns (128 for V4, 32 for V4.1; a ragged last group is allowed), each group gets one fp32
scale s = max(|x|, 1e-4) / 448 (rounded up to a power of two when the checkpoint's scales are ue8m0), and the
codes are x / s rounded to nearest-even e4m3.

The kernel encodes the e4m3 bytes with integer and fp32 arithmetic (`fp8.encode`) rather than a float8 cast,
so one body runs on every target, the CPU `c` target included (it has no float8 types); the bytes equal
torch's own `to(torch.float8_e4m3fn)`.
"""

from dataclasses import dataclass

import torch

from tilekernels import dtypes, fp8
from tilekernels.op import Kernel, OpDecl, Override, require
from tilekernels.ops import act_quant_nvidia
from tilekernels.quant import FP8_MAX

AMAX_FLOOR = 1e-4  # DeepSeek's clamp: an all-zero group still gets a finite scale
WIDE_ROWS = 128  # up to this many rows (decode) the portable body: at one row it took 9.1 us against the override's
#                  15.2; at 128 rows 9.4 against 10.4 (K 4096) and 14.0 against 10.4 (K 8192) (H100,
#                  `benchmarks/kernels.py --ops act_quant`); above, the override (4,096 rows: 3.6-4.2x)


def reference(x: torch.Tensor, group: int, pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (codes float8_e4m3fn [M, K], scales fp32 [M, ceil(K / group)])."""
    m, k = x.shape
    groups = -(-k // group)
    xf = torch.nn.functional.pad(x.float(), (0, groups * group - k)).view(m, groups, group)
    scale = xf.abs().amax(-1).clamp(min=AMAX_FLOOR) / FP8_MAX
    if pow2:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    codes = (xf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes.view(m, groups * group)[:, :k].contiguous(), scale


@dataclass(frozen=True)
class Variant:
    k: int  # columns
    group: int  # columns per scale
    dtype: str  # the activations' dtype
    pow2: bool = False  # ue8m0 scales: powers of two
    wide: bool = False  # more than WIDE_ROWS rows (prefill): the NVIDIA override's row tiles


@dataclass(frozen=True)
class Config:
    threads: int = 128
    rows: int = 32  # NVIDIA override (`act_quant_nvidia`): rows per CTA


def body(P, v: Variant, cfg: Config):
    """One program per (row, group): the group's max magnitude, its scale, and the e4m3 byte of each value."""
    T = P.T
    K, G, dtype = v.k, v.group, v.dtype
    KB = -(-K // G)
    GP = P.padded(G, cfg.threads)
    M = T.dynamic("M")

    @T.prim_func
    def kernel(X: T.Tensor((M, K), dtype), Q: T.Tensor((M, K), "uint8"), S: T.Tensor((M, KB), "float32")):
        with P.kernel(M * KB, cfg.threads) as pid:
            x_io = P.alloc_io((GP,), dtype)
            q_io = P.alloc_io((GP,), "uint8")
            s_io = P.alloc_io((1,), "float32")
            for t in P.tiles(M * KB, pid):
                row = t // KB
                k0 = t % KB * G
                T.copy(X[row, k0:k0 + G], x_io[0:G])  # a ragged last group reads zeros past K
                with P.vector(cfg.threads):
                    mag = P.alloc_reg((GP,), "float32")
                    top = P.alloc_reg((1,), "float32")
                    for j in T.Parallel(GP):
                        mag[j] = T.if_then_else(j < G, T.cast(x_io[T.min(j, G - 1)], "float32"), 0.0)
                        mag[j] = T.max(mag[j], -mag[j])
                    T.reduce_max(mag, top, dim=0)
                    for j in T.Parallel(1):
                        s = T.max(top[0], AMAX_FLOOR) / FP8_MAX
                        s_io[0] = fp8.pow2_ceil(T, s) if v.pow2 else s
                    for j in T.Parallel(GP):
                        if j < G:
                            q_io[j] = fp8.encode(T, T.cast(x_io[T.min(j, G - 1)], "float32") / s_io[0])
                T.copy(q_io[0:G], Q[row, k0:k0 + G])
                T.copy(s_io, S[row, t % KB:t % KB + 1])

    return kernel


KERNEL = Kernel("act_quant", body, configs={"default": Config(), "c": Config(threads=1)},
                overrides=(Override("sm90", act_quant_nvidia.fits, act_quant_nvidia.body),
                           Override("sm100", act_quant_nvidia.fits, act_quant_nvidia.body)))


def variant(x: torch.Tensor, group: int, pow2: bool) -> Variant:
    return Variant(x.shape[-1], group, dtypes.name(x.dtype), pow2, x.shape[0] > WIDE_ROWS)


def run(launch, x: torch.Tensor, group: int, pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    require(x.dim() == 2, "act_quant", f"x must be [M, K], got {list(x.shape)}")
    require(group in (32, 64, 128), "act_quant", f"group must be 32, 64 or 128 columns, got {group}")
    v = variant(x, group, pow2)
    rows = x.contiguous()
    codes = torch.empty(rows.shape, dtype=torch.uint8, device=x.device)
    scales = torch.empty(rows.shape[0], -(-v.k // group), dtype=torch.float32, device=x.device)
    launch("act_quant", v)(rows, codes, scales)
    return codes.view(torch.float8_e4m3fn), scales


def example(v: Variant, rows: int, device) -> tuple:
    """Rows of mixed magnitudes (some groups tiny, one all zero) so that scales and subnormal codes vary."""
    dtype = dtypes.torch_dtype(v.dtype)
    x = torch.randn(rows, v.k, device=device) * torch.logspace(-6, 3, rows, device=device)[:, None]
    x[0, : v.group] = 0.0
    return (x.to(dtype), v.group, v.pow2)


OP = OpDecl(
    "act_quant", "per-token-group FP8 activation quantization", reference,
    kernels=(KERNEL,),
    tolerance={"float32": (0.0, 0.0), "bfloat16": (0.0, 0.0)},
    run=run, example=example, row_samples=(WIDE_ROWS + 1,),
)
