"""Block-quantized weights as the ops take them: DeepSeek-V4's checkpoint formats kept in their own precision.

- `fp8`: FP8 e4m3 values [..., N, K] with one scale per `block` (rows x columns; 128x128 in V4, 32x32 in
  V4.1) of the weight.
- `fp4`: FP4 e2m1 values packed two per byte (low nibble first) [..., N, K/2] with one scale per 1x32 block.

Scales are the checkpoints' `weight_scale_inv` multipliers (value = code * scale), kept as the checkpoint
stores them: fp32, or ue8m0 (one exponent byte, `float8_e8m0fnu` or uint8) so FP4 experts cost 0.53 bytes per
value on the device. An op's reference dequantizes and computes in fp32; kernels read the
values and scales directly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
FP4_BLOCK = (1, 32)
FP8_MAX = 448.0  # the largest finite e4m3 value
FP4_MAX = 6.0
FP8_DTYPES = (torch.float8_e4m3fn,)
FORMATS = ("fp8", "fp4")


def scale_to_float(scale: torch.Tensor) -> torch.Tensor:
    """A checkpoint's scale tensor (fp32, bf16, ue8m0 `float8_e8m0fnu`, or raw e8m0 exponent bytes) -> fp32."""
    if scale.dtype == torch.uint8:  # raw e8m0 exponents
        return (scale.to(torch.float32) - 127.0).exp2()
    return scale.to(torch.float32)


def is_exponent_bytes(scale: torch.Tensor) -> bool:
    """Whether a scale tensor holds ue8m0 exponents (uint8 bytes or `float8_e8m0fnu`)."""
    return scale.dtype == torch.uint8 or scale.dtype == getattr(torch, "float8_e8m0fnu", None)


def exponent_bytes(scale: torch.Tensor) -> torch.Tensor:
    """ue8m0 scales as uint8 exponent bytes, the form the kernels read: a view of exponent bytes, or power-of-two
    fp32 scales converted (2^e -> e + 127)."""
    if is_exponent_bytes(scale):
        return scale.view(torch.uint8)
    return (torch.log2(scale.float()).round() + 127).to(torch.uint8)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] bytes holding two e2m1 values each (low nibble first) -> fp32 [..., K]."""
    lut = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32, device=packed.device)
    u8 = packed.contiguous().view(torch.uint8)
    values = torch.stack([lut[(u8 & 0xF).long()], lut[(u8 >> 4).long()]], dim=-1)
    return values.reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def grid(rows: int, cols: int, block: tuple[int, int]) -> tuple[int, int]:
    return -(-rows // block[0]), -(-cols // block[1])


class LayoutError(ValueError):
    """A block-quantized weight in a kernel's own layout (K-permuted FP4) read as if it were plain."""


KPERM_WORDS = torch.int32  # the dtype of K-permuted FP4 values: (..., N, K/8) words (`layout`)


@dataclass(frozen=True)
class BlockQuantized:
    """A weight [..., N, K] in a block-scaled format: `values` (fp8 [..., N, K] or packed fp4 uint8
    [..., N, K/2]), `scales` [..., ceil(N/block[0]), ceil(K/block[1])] (fp32 or ue8m0).

    FP4 experts may also be held in the K-permuted layout of the sm_90a kernel (`moe_fp4_sm90.repack`, chosen by
    `moe_experts.kernel_layout`): values int32 words [..., N, K/8], scales their exponent bytes permuted, as int32
    words [..., N, K/128] ("kperm1": every exponent byte <= 128) or as bytes [..., N, K/32] ("kperm"). The layout
    is told by the tensors' dtypes (`layout`), so any copy of them keeps it; `dequantize` refuses it (`plain()`
    un-permutes)."""

    values: torch.Tensor
    scales: torch.Tensor
    block: tuple[int, int]
    format: str

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"format {self.format!r} is not one of {FORMATS}")
        rows, cols = self.shape[-2:]
        want = tuple(self.values.shape[:-2]) + grid(rows, cols, self.block)
        have = tuple(self.scales.shape)
        if self.values.dtype == KPERM_WORDS and self.scales.dtype == KPERM_WORDS:  # exponent bytes as words
            have = have[:-1] + (4 * have[-1],)
        if have != want:
            raise ValueError(f"scales {list(self.scales.shape)} do not match the {self.block[0]}x{self.block[1]} "
                             f"block grid {list(want)} of a {rows}x{cols} weight")

    @property
    def shape(self) -> torch.Size:
        """The logical (dequantized) shape."""
        k = self.values.shape[-1] * ((8 if self.values.dtype == KPERM_WORDS else 2) if self.format == "fp4" else 1)
        return torch.Size((*self.values.shape[:-1], k))

    @property
    def device(self) -> torch.device:
        return self.values.device

    @property
    def nbytes(self) -> int:
        return self.values.numel() * self.values.element_size() + self.scales.numel() * self.scales.element_size()

    def dim(self) -> int:
        return len(self.shape)

    @property
    def layout(self) -> str:
        """"plain", or the K-permuted FP4 layout with the decoder its exponents allow: "kperm" / "kperm1"."""
        if self.format != "fp4" or self.values.dtype != KPERM_WORDS:
            return "plain"
        return "kperm1" if self.scales.dtype == KPERM_WORDS else "kperm"

    def plain(self) -> BlockQuantized:
        """The same weight in the plain layout (K-permuted FP4 un-permuted, exactly; a plain one as it is)."""
        if self.layout == "plain":
            return self
        from tilekernels.ops import moe_fp4_sm90

        lead = self.values.shape[:-2]
        values, scales = moe_fp4_sm90.unpermute(self.values.reshape(-1, *self.values.shape[-2:]),
                                                self.scales.reshape(-1, *self.scales.shape[-2:]))
        return BlockQuantized(values.reshape(*lead, *values.shape[-2:]), scales.reshape(*lead, *scales.shape[-2:]),
                              self.block, self.format)

    def with_exponent_bytes(self) -> BlockQuantized:
        """The same tensor with its power-of-two scales as ue8m0 exponent bytes (the form kernels read)."""
        if self.layout != "plain":
            return self
        return BlockQuantized(self.values, exponent_bytes(self.scales), self.block, self.format)

    def to(self, device: torch.device | str) -> BlockQuantized:
        return BlockQuantized(self.values.to(device), self.scales.to(device), self.block, self.format)

    def __getitem__(self, index) -> BlockQuantized:
        """One slice of the leading (expert) dimension, or (an index tensor) those experts, copied."""
        return BlockQuantized(self.values[index], self.scales[index], self.block, self.format)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.layout != "plain":
            raise LayoutError(f"a {list(self.shape)} FP4 weight in the K-permuted layout {self.layout!r} cannot be "
                              f"dequantized as plain; un-permute it first (.plain())")
        rows, cols = self.shape[-2:]
        codes = self.values.to(torch.float32) if self.format == "fp8" else unpack_fp4(self.values)
        full = scale_to_float(self.scales).repeat_interleave(self.block[0], dim=-2).repeat_interleave(self.block[1], dim=-1)
        return (codes * full[..., :rows, :cols]).to(dtype)


def cat_rows(parts: list[BlockQuantized]) -> BlockQuantized:
    """Concatenate along N (rows); every part but the last must end on a block boundary."""
    first = parts[0]
    for p in parts[:-1]:
        if p.shape[-2] % first.block[0]:
            raise ValueError(f"cannot join block-quantized weights along rows: {p.shape[-2]} rows is not a multiple "
                             f"of the block's {first.block[0]}")
    return BlockQuantized(torch.cat([p.values for p in parts], dim=-2), torch.cat([p.scales for p in parts], dim=-2),
                          first.block, first.format)


def dense(weight: torch.Tensor | BlockQuantized, dtype: torch.dtype) -> torch.Tensor:
    """The weight as a plain tensor of `dtype` (dequantized when block-quantized): what references compute with."""
    if isinstance(weight, BlockQuantized):
        return weight.dequantize(dtype)
    return weight if weight.dtype == dtype else weight.to(dtype)


def quantize(weight: torch.Tensor, format: str, block: tuple[int, int] | None = None,
             pow2_scales: bool = True) -> BlockQuantized:
    """Round a weight [..., N, K] to a block-scaled format (the synthetic checkpoints' generator and tests): each
    block's scale maps its largest magnitude onto the format's largest value (a power of two with
    `pow2_scales`, as ue8m0 needs, rounded up so nothing clips). Leading dims are done one slice at a time."""
    block = FP4_BLOCK if format == "fp4" else (block or (128, 128))
    if weight.dim() > 2:
        parts = [quantize(w, format, block, pow2_scales) for w in weight.reshape(-1, *weight.shape[-2:])]
        lead = weight.shape[:-2]
        return BlockQuantized(torch.stack([p.values for p in parts]).reshape(*lead, *parts[0].values.shape),
                              torch.stack([p.scales for p in parts]).reshape(*lead, *parts[0].scales.shape),
                              block, format)
    w = weight.to(torch.float32)
    rows, cols = w.shape
    g = grid(rows, cols, block)
    pad = torch.nn.functional.pad(w, (0, g[1] * block[1] - cols, 0, g[0] * block[0] - rows))
    amax = pad.reshape(g[0], block[0], g[1], block[1]).abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale = amax / (FP4_MAX if format == "fp4" else FP8_MAX)
    if pow2_scales:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    full = scale.repeat_interleave(block[0], dim=0).repeat_interleave(block[1], dim=1)[:rows, :cols]
    scaled = w / full
    if format == "fp8":
        return BlockQuantized(scaled.to(torch.float8_e4m3fn), scale, block, "fp8")
    mags = torch.tensor(FP4_E2M1_VALUES[:8], dtype=torch.float32, device=w.device)
    codes = torch.bucketize(scaled.abs(), (mags[1:] + mags[:-1]) / 2).to(torch.uint8)  # nearest magnitude
    codes |= ((scaled < 0) & (codes > 0)).to(torch.uint8) << 3
    return BlockQuantized(codes[:, 0::2] | (codes[:, 1::2] << 4), scale, block, "fp4")
