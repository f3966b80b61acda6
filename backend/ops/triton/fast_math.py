"""The natural log through the GPU's special-function unit (MUFU lg2.approx) where kernels are compiled.

Where a kernel takes a log of every logit, libdevice's accurate logf (a polynomial of a dozen instructions with its
range reduction) sets the kernel's pace, not its memory traffic (the sampler's pass 1: docs/benchmarks.md has the
figures). lg2.approx's error is at most 2**-22 absolute in log2 over the inputs used here: use it only
where such an error is below the rounding of what the result is added to. Triton's CPU interpreter has no
libdevice, so there the exact log stands in.
"""
from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # the dispatcher catches this and keeps the plain-torch path
    raise ImportError("backend.ops.triton.fast_math needs the `triton` package") from exc

from backend.ops.triton.launch import INTERPRET  # noqa: E402  (after the guarded import)

__all__ = ["fast_log"]

if INTERPRET:
    @triton.jit
    def fast_log(x):
        """log(x), exactly: the interpreter runs kernels on numpy, which has no fast log to mirror."""
        return tl.log(x)

else:
    from triton.language.extra.cuda import libdevice

    @triton.jit
    def fast_log(x):
        """log(x) as lg2.approx(x) * ln 2 (libdevice's __nv_fast_logf)."""
        return libdevice.fast_logf(x)
