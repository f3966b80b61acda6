"""GPU busy as kernel time: the union of the CUDA kernel intervals torch.profiler (CUPTI) saw, over the wall time.

The engine's timeline measures each step's device work as a span from event to event; where the launches come
slower than the kernels run, the span holds idle gaps, so it counts such spans apart (gpu_busy_uncertain) and its
gpu_busy from the others. This is the figure it is checked against (`python -m bench.offline ... --kernel-busy`).
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from backend.executor.graph_idle import is_kernel
from backend.runtime.timeline import union_length


def kernel_intervals(prof) -> list[tuple[float, float]]:
    """(start, end) µs of every kernel in a finished torch.profiler run (copies and memsets left out)."""
    out = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and is_kernel(e.name):
            out.append((e.time_range.start, e.time_range.end))
    return out


def kernel_table(prof, top: int) -> list[dict]:
    """The `top` kernels by total GPU time in a finished torch.profiler run: name, calls, ms, share of kernel time."""
    totals: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA or not is_kernel(e.name):
            continue
        entry = totals.setdefault(e.name, [0, 0.0])
        entry[0] += 1
        entry[1] += e.time_range.end - e.time_range.start
    all_us = sum(us for _, us in totals.values()) or 1.0
    rows = sorted(totals.items(), key=lambda kv: -kv[1][1])[:top]
    return [dict(name=name[:90], calls=calls, ms=round(us / 1e3, 2), share=round(us / all_us, 4))
            for name, (calls, us) in rows]


def run_with_kernel_busy(fn: Callable[[], object], top: int = 0) -> tuple[object, float, float, list[dict]]:
    """Run fn under torch.profiler's CUDA activity; return (its result, wall seconds, kernel-busy fraction, the top
    kernels by time when top > 0)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        result = fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    busy_us = union_length(kernel_intervals(prof))
    return result, wall, busy_us / 1e6 / wall, kernel_table(prof, top) if top else []
