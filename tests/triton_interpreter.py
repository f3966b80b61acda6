"""Triton's CPU interpreter with a GPU's bfloat16 numerics, so CPU runs of the kernels give the GPU's bits.

The interpreter (TRITON_INTERPRET=1, triton 3.6) stores bf16 values as their raw uint16 bits and gets two things
wrong with them: a dot multiplies the bits as integers, and a cast from fp32 truncates (the GPU rounds to nearest
even). Both are mended here at run time, in this process, by wrapping the interpreter builder's `create_dot` and
`cast_impl`; the installed package is left as it is. Every other bf16 operation our kernels use (loads, stores,
`tl.where` on loaded values) moves the bits unchanged, which is already right.

FP8 e4m3 (`tl.float8e4nv`, torch's float8_e4m3fn) is stored as raw uint8 bits too, and the interpreter's generic
bit conversion reads 0x7F / 0xFF as 480 (e4m3fn has no infinities: they are NaN) and rounds a downcast half-up
without carrying into the exponent. So its conversions (`create_fp_to_fp`) and dot operands are mended as well:
e4m3 → float32 by a 256-entry table, float32 → e4m3 rounded to nearest even and saturated to ±448 (the GPU's
cvt.rn.satfinite), NaN kept.
"""
from __future__ import annotations

import numpy as np


def _bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _f32_to_bf16(values: np.ndarray) -> np.ndarray:
    """Round to nearest even, as the GPU's cvt.rn.bf16.f32 does; NaN stays a (quiet) NaN."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = ((bits + (0x7FFF + ((bits >> 16) & 1))) >> 16).astype(np.uint16)
    return np.where(np.isnan(values), np.uint16(0x7FC0), rounded)


def _e4m3_table() -> np.ndarray:
    """The float32 value of each of the 256 e4m3fn bit patterns (0x7F and 0xFF are NaN)."""
    bits = np.arange(256, dtype=np.uint32)
    exp, man = (bits >> 3) & 0xF, bits & 0x7
    mag = np.where(exp == 0, man / 8.0 * 2.0 ** -6, (1 + man / 8.0) * 2.0 ** (exp.astype(np.int32) - 7))
    mag = np.where((exp == 15) & (man == 7), np.nan, mag)
    return np.where(bits & 0x80, -mag, mag).astype(np.float32)


_E4M3_TO_F32 = _e4m3_table()
_E4M3_POSITIVE = _E4M3_TO_F32[:127].astype(np.float64)  # bits 0x00..0x7E: the finite magnitudes, ascending


def _f32_to_e4m3(values: np.ndarray) -> np.ndarray:
    """Round to the nearest e4m3fn value (ties to the even bit pattern), saturated at ±448; NaN → 0x7F."""
    v = np.asarray(values, dtype=np.float32).astype(np.float64)
    mag = np.minimum(np.abs(v), 448.0)
    hi = np.clip(np.searchsorted(_E4M3_POSITIVE, mag), 0, 126)
    lo = np.maximum(hi - 1, 0)
    below, above = mag - _E4M3_POSITIVE[lo], _E4M3_POSITIVE[hi] - mag
    pick = np.where((above < below) | ((above == below) & (hi % 2 == 0)), hi, lo).astype(np.uint8)
    signed = pick | np.where(np.signbit(v), np.uint8(0x80), np.uint8(0))
    return np.where(np.isnan(v), np.uint8(0x7F), signed).astype(np.uint8)


def install() -> None:
    """Wrap the interpreter's dot and cast (once per process); a no-op when they are already wrapped."""
    import triton.language as tl
    from triton.runtime import interpreter as interp

    builder = type(interp.interpreter_builder)
    if getattr(builder, "_tandem_bf16", False):
        return
    original_dot, original_cast = builder.create_dot, builder.cast_impl

    def widen(x):
        if x.dtype.scalar == tl.bfloat16:
            return interp.TensorHandle(_bf16_to_f32(x.data), tl.float32)
        if x.dtype.scalar == tl.float8e4nv:
            return interp.TensorHandle(_E4M3_TO_F32[x.data], tl.float32)
        return x

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    def cast_impl(self, src, dst_type):
        src_ty, dst_ty = src.dtype.scalar, dst_type.scalar
        if dst_ty == tl.bfloat16 and src_ty != tl.bfloat16:
            values = widen(src).data.astype(np.float32)
            return interp.TensorHandle(_f32_to_bf16(values).reshape(np.shape(src.data)), tl.bfloat16)
        if src_ty == tl.bfloat16 and dst_ty != tl.bfloat16:
            return original_cast(self, widen(src), dst_type)
        return original_cast(self, src, dst_type)

    original_fp_to_fp = builder.create_fp_to_fp

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        # every cast to or from an FP8 type comes here; only e4m3fn is mended
        src_ty, dst_ty = src.dtype.scalar, dst_type.scalar
        if src_ty == tl.float8e4nv:
            return cast_impl(self, widen(src), dst_type)  # exact: every e4m3 value is a bf16 / fp16 / fp32 value
        if dst_ty == tl.float8e4nv:
            values = widen(src).data.astype(np.float32)
            return interp.TensorHandle(_f32_to_e4m3(values).reshape(np.shape(src.data)), tl.float8e4nv)
        return original_fp_to_fp(self, src, dst_type, rounding_mode)

    builder.create_dot = create_dot
    builder.cast_impl = cast_impl  # the builder's create_fp_ext, create_fp_trunc, ... all call it
    builder.create_fp_to_fp = create_fp_to_fp
    builder._tandem_bf16 = True
