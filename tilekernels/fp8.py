"""FP8 e4m3 encode / decode as TileLang expressions in integer and fp32 arithmetic (no float8 types), so
that portable kernel bodies read and write FP8 bytes on every target, the CPU `c` target included.

e4m3 (the `fn` variant DeepSeek uses): sign, 4 exponent bits (bias 7), 3 mantissa bits; largest finite value
448; subnormals m * 2^-9. Powers of two are built from their exponent bits, so every scaling is exact.
These helpers return expressions (they emit no statements), so they are safe to call from kernel bodies.
"""

from __future__ import annotations

from typing import Any


def pow2(T: Any, exponent: Any) -> Any:
    """2^exponent (an int32 expression in [-126, 127]) as fp32, exactly."""
    return T.reinterpret(T.shift_left(exponent + 127, 23), "float32")


def exponent_of(T: Any, x: Any) -> Any:
    """floor(log2(x)) of a non-negative normal fp32 x (-127 for 0), read from its exponent bits."""
    return T.shift_right(T.reinterpret(x, "int32"), 23) - 127


def pow2_ceil(T: Any, x: Any) -> Any:
    """The smallest power of two >= x (a positive normal fp32): ue8m0 scale rounding."""
    bits = T.reinterpret(x, "int32")
    return pow2(T, exponent_of(T, x) + T.if_then_else(T.bitwise_and(bits, 0x7FFFFF) != 0, 1, 0))


def encode(T: Any, v: Any) -> Any:
    """The e4m3 byte (uint8) of fp32 v: magnitude clamped to 448, rounded to nearest-even; the same byte torch's
    `to(torch.float8_e4m3fn)` gives for |v| <= 448. With e = max(floor(log2|v|), -6) and the magnitude's 4 bits
    r = round(|v| * 2^(3-e)) in [0, 16], the byte is 8 * (e + 6) + r (a mantissa carry to 16 lands on the
    next exponent's first code, and e = -6 covers the subnormals)."""
    a = T.min(T.max(v, -v), 448.0)  # no T.abs: the c target has no fabs lowering
    e = T.max(exponent_of(T, a), -6)
    t = a * pow2(T, 3 - e)
    r = T.floor(t + 0.5)
    ri = T.cast(r, "int32")
    tie_to_odd = T.And(r - t == 0.5, T.bitwise_and(ri, 1) == 1)
    code = (e + 6) * 8 + T.if_then_else(tie_to_odd, ri - 1, ri)
    negative = T.reinterpret(v, "int32") < 0  # the sign bit: -0.0 is 0x80, as torch gives it
    return T.cast(T.if_then_else(negative, code + 128, code), "uint8")


def decode(T: Any, byte: Any) -> Any:
    """The fp32 value of an e4m3 byte (a uint8 or int32 expression): (8 + m) * 2^(e-10) for e > 0,
    m * 2^-9 for subnormals. NaN codes (0x7F, 0xFF) decode as 480; checkpoints and `encode` never make them."""
    b = T.cast(byte, "int32")
    e = T.bitwise_and(T.shift_right(b, 3), 15)
    m = T.bitwise_and(b, 7) + T.if_then_else(e > 0, 8, 0)
    mag = T.cast(m, "float32") * pow2(T, T.max(e, 1) - 10)
    return T.if_then_else(T.bitwise_and(b, 128) != 0, -mag, mag)
