"""Triton's CPU interpreter with a GPU's bfloat16 numerics, so CPU runs of the kernels give the GPU's bits.

The interpreter (TRITON_INTERPRET=1, triton 3.6) stores bf16 values as their raw uint16 bits and gets two things
wrong with them: a dot multiplies the bits as integers, and a cast from fp32 truncates (the GPU rounds to nearest
even). Both are mended here at run time, in this process, by wrapping the interpreter builder's `create_dot` and
`cast_impl`; the installed package is left as it is. Every other bf16 operation our kernels use (loads, stores,
`tl.where` on loaded values) moves the bits unchanged, which is already right.
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

    builder.create_dot = create_dot
    builder.cast_impl = cast_impl  # the builder's create_fp_ext, create_fp_trunc, ... all call it
    builder._tandem_bf16 = True
