"""The idle time inside each captured graph, measured once after capture, so GPU busy can count kernel time.

A step that replays graphs is timed by two events around the replays. The span between them holds the graphs'
kernels and the short gaps between one kernel's end and the next one's start inside a graph, which events cannot
see: on an H200 with the Llama-3.2-1B shape they were 9-13 µs a replay at up to 64 rows and 71-84 µs at 128-256 rows,
whatever the context length (16-2,048), a few points of a 2 ms step (2026-12-03, de6f252, each graph replayed behind
a spin kernel under torch.profiler). So after capture each graph is replayed a few
times under torch.profiler's CUDA activity (CUPTI), the GPU kept ahead of the CPU by a spin kernel so that no
replay waits for its launch, and its event span less the union of its kernels is kept as that graph's idle time.
The timeline subtracts it from each span of a replay of that graph.
"""
from __future__ import annotations

import logging
from typing import Callable, Hashable

import torch

from backend.runtime.timeline import union_length

log = logging.getLogger(__name__)

SPIN_CYCLES = 4_000_000  # ~2 ms at H200 clocks: longer than the CPU takes to queue one graph's replays
_SPIN_NAME = "spin_kernel"  # torch.cuda._sleep's kernel: marks where each graph's replays start


def idle_per_replay(kernels: list[tuple[str, int, float, float]], spans: list[list[float]]) -> list[float] | None:
    """Per group of replays, the mean of (event span − the union of its kernels), at least 0.

    kernels: (name, stream, start, end) of every kernel the profiler saw, times in seconds; each group's kernels
    follow a spin kernel on the spin kernels' stream, in the order of the groups (kernels on other streams, such as
    the inputs' set-up, are left out). spans: per group, each replay's event span in seconds. None when the kernels
    do not split into as many groups as there are span lists."""
    spin_streams = {stream for name, stream, _, _ in kernels if _SPIN_NAME in name}
    if len(spin_streams) != 1:
        return None
    groups: list[list[tuple[float, float]]] = []
    for name, stream, start, end in sorted(kernels, key=lambda k: k[2]):
        if stream not in spin_streams:
            continue
        if _SPIN_NAME in name:
            groups.append([])
        elif groups:
            groups[-1].append((start, end))
    if len(groups) != len(spans) or any(not g for g in groups):
        return None
    return [max(0.0, (sum(s) - union_length(g)) / len(s)) for g, s in zip(groups, spans)]


Replay = tuple[Hashable, Callable[[], None], Callable[[], None]]  # (key, set-up of its inputs, one replay)


_NOT_KERNELS = ("Memcpy", "Memset", "cudaMemcpy", "cudaMemset")  # CUDA activities CUPTI lists beside kernels


def is_kernel(activity_name: str) -> bool:
    """A profiler's CUDA activity that is a kernel (copies and memsets are not)."""
    return not activity_name.startswith(_NOT_KERNELS)


def measure_graph_idle(replays: list[Replay], stream: torch.cuda.Stream, repeats: int = 2
                       ) -> dict[Hashable, float] | None:
    """Each graph's idle seconds per replay (see the module's docstring), its inputs set up first on the current
    stream; None if CUPTI gave no usable record (graph spans then count as holding unknown idle)."""
    try:
        spans: list[list[float]] = []
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _, set_up, replay in replays:
                set_up()
                # why: the replays read the inputs the current stream has just written
                stream.wait_stream(torch.cuda.current_stream())
                events = []
                with torch.cuda.stream(stream):
                    torch.cuda._sleep(SPIN_CYCLES)
                    for _ in range(repeats):
                        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        start.record(stream)
                        replay()
                        end.record(stream)
                        events.append((start, end))
                # why: the next set-up overwrites these inputs, and its graph's group starts behind its own spin
                stream.synchronize()
                spans.append([s.elapsed_time(e) / 1e3 for s, e in events])
        kernels = [(e.name(), e.device_resource_id(), e.start_ns() / 1e9, e.end_ns() / 1e9)
                   for e in prof.profiler.kineto_results.events()
                   if e.device_type() == torch.autograd.DeviceType.CUDA
                   and is_kernel(e.name())]
    except Exception as exc:  # noqa: BLE001 - no CUPTI (or a profiler failure) must not stop the engine
        log.warning("graph idle time not measured (%s): GPU busy counts graph replays as uncertain", exc)
        return None
    idle = idle_per_replay(kernels, spans)
    if idle is None:
        log.warning("graph idle time not measured: the profiler's kernels did not match the replays")
        return None
    return {key: seconds for (key, _, _), seconds in zip(replays, idle)}
