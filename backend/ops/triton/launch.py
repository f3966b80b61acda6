"""Programmatic dependent launch (Hopper and later) for the Triton-language kernels of a decode step.

A decode step of a small model is some 170 short kernels, each a few microseconds long, and each pays its launch
and the ramp-up of its first loads after the previous kernel has drained. Launched with `launch_pdl`, a kernel's
programs may start as soon as every program of the previous kernel has started; they wait in `dependent_wait`
until that kernel has finished and its writes are visible. The launch and the programs' start overlap the
previous kernel's tail. (Asking L2 for the first weight tiles before the wait was tried too: the decode GEMMs
of the 1B model at 64 rows ran no faster, 3.55 against 3.57 and 2.56 against 2.58 TB/s, so nothing runs there.)

Every kernel launched this way must call `dependent_wait` before it touches any other memory, in every program
(also ones that return early): then kernel N+2, which waits for N+1, also waits for N.
"""
from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # the dispatcher catches this and keeps the plain-torch path
    raise ImportError("backend.ops.triton.launch needs the `triton` package") from exc

__all__ = ["INTERPRET", "allow_dependents", "dependent_wait"]

# Triton's CPU interpreter (TRITON_INTERPRET=1, read when the kernels are defined): kernels take CPU tensors, and
# each launch runs all its programs to the end before the next launch starts.
INTERPRET = bool(triton.knobs.runtime.interpret)

if INTERPRET:
    # The interpreter has no grid-dependency control, and needs none: a launch begins only after the previous one
    # has ended, which is what dependent_wait waits for. The PDL flags still travel through every launch.
    @triton.jit
    def allow_dependents(PDL: tl.constexpr):
        """No-op under the interpreter (see above)."""
        pass

    @triton.jit
    def dependent_wait(PDL: tl.constexpr):
        """No-op under the interpreter (see above)."""
        pass

else:
    @triton.jit
    def allow_dependents(PDL: tl.constexpr):
        """Let the next kernel's programs start once all of this kernel's programs have started (they never
        take a slot one of ours still needs: the next kernel launches only after our last program is placed)."""
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def dependent_wait(PDL: tl.constexpr):
        """Block until the previous kernel has finished and its writes are visible."""
        if PDL:
            # why: our inputs may be its outputs, and our outputs may reuse a buffer it still reads
            tl.extra.cuda.gdc_wait()
