"""CPU and GPU spans of the engine loop: busy fraction, CPU time per step, Chrome trace and a PNG picture.

A GPU span runs from an event recorded before a step's device work to one recorded after it. It is exact (kernel
time, no idle gaps inside) when its work went to the GPU as graph replays or a single copy, or when the GPU had not
reached its start event by the time every launch of the span was queued: the kernels then ran back to back. Other
spans are uncertain: launched one kernel at a time while the GPU kept up, they may hold the gaps between launches.
A span of graph replays also holds the idle gaps between the kernels inside the graphs, which no event sees: their
length, measured once per graph after capture (backend/executor/graph_idle.py), is the span's idle time, left out
of the busy figures; a replay of a graph whose idle was not measured makes its span uncertain.
The busy figures count exact spans only, less their idle (a lower bound, kernel time when nothing is uncertain);
the uncertain share is the wall time that only uncertain spans cover, so busy + uncertain + idle is the union of
every span (an upper bound). Copy spans (a step's host-to-device and device-to-host copies) are no kernel time and
count in neither; they are recorded only when asked for (copy_spans), for the picture of the three streams.
"""
from __future__ import annotations

import collections
import contextlib
import json
import statistics
import threading
import time
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class Span:
    """One named interval on the CPU row or the GPU row, in seconds since the timeline's origin."""

    row: str  # "cpu" | "gpu"
    name: str
    start: float
    end: float
    step: int
    exact: bool = True  # GPU row: the span holds no launch gaps (see the module's docstring)
    idle: float = 0.0  # GPU row: seconds of the span known to be idle (inside replayed graphs)
    kernels: bool = True  # GPU row: kernel work, counted by the busy figures (False: a copy, shown only)


MAX_SPANS = 500_000  # about 45,000 steps: a whole benchmark, or a server's last minutes (older spans drop off)


def union_length(intervals) -> float:
    """Total length the (start, end) intervals cover, overlaps counted once."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


class RunningUnion:
    """Length covered by intervals added in the order they resolve, O(1) each, less their idle time; one that fills
    a gap left behind the furthest end so far is missed, so it can read low."""

    __slots__ = ("total", "end")

    def __init__(self) -> None:
        self.total = 0.0
        self.end = 0.0

    def add(self, start: float, end: float, idle: float = 0.0) -> None:
        """An interval holding idle seconds of no work: the share of them in its part past the furthest end so far
        is left out too."""
        if end > self.end:
            new = end - max(start, self.end)
            self.total += new - (idle * new / (end - start) if idle > 0.0 else 0.0)
            self.end = end


ANCHOR_BRACKET_S = 0.002  # the host clock must be read within this long of placing the anchor
ANCHOR_TRIES = 5


def anchored_origin(place_anchor, clock, bracket_s: float = ANCHOR_BRACKET_S, tries: int = ANCHOR_TRIES) -> float:
    """The host time at which the GPU ran the anchor event place_anchor() records and waits for.

    Every GPU span is placed on the host clock by its distance from the anchor, so an origin read late shifts all of
    them late against the CPU's spans and stretches the window the busy fraction divides by. A thread held up between
    the wait and the clock read (another thread holding Python's lock through a long call, such as a profiler's
    start) reads it late. So the wait is bracketed by two clock reads and the anchor placed again while the bracket
    is wider than bracket_s (the last try is taken as it is)."""
    for _ in range(tries):
        before = clock()
        place_anchor()
        after = clock()
        if after - before <= bracket_s:
            break
    return after


class _CpuSpan:
    """One CPU span being recorded: Timeline.cpu_span's context."""

    __slots__ = ("timeline", "name", "start")

    def __init__(self, timeline: "Timeline", name: str) -> None:
        self.timeline = timeline
        self.name = name
        self.start = 0.0

    def __enter__(self) -> None:
        self.start = self.timeline.now()

    def __exit__(self, *exc) -> None:  # recorded whether or not the body raised, and the exception goes on
        tl = self.timeline
        tl.spans.append(Span("cpu", self.name, self.start, tl.now(), tl._step))


_NO_SPAN = contextlib.nullcontext()  # a disabled timeline's span: reusable, records nothing


class Timeline:
    """Records spans at low cost when enabled; switchable at run time; does nothing when disabled."""

    def __init__(self, enabled: bool = False, use_cuda: bool = False, max_spans: int = MAX_SPANS,
                 copy_spans: bool = False) -> None:
        self.use_cuda = use_cuda
        self.enabled = False
        # record copy spans too: they are no kernel time, so only a picture of the streams needs them (each costs
        # two events and a query a step)
        self.copy_spans = copy_spans
        self.spans: collections.deque[Span] = collections.deque(maxlen=max_spans)
        # (name, start event, end event, step, exact, idle seconds, kernels), in recording order
        self._pending_gpu: collections.deque[tuple[str, object, object, int, bool, float, bool]] = collections.deque()
        self._open_gpu: dict[str, tuple[object, bool]] = {}  # name -> (start event or time, kernels)
        self._free_events: list = []
        self._step = 0
        self._origin = time.perf_counter()
        self._anchor = None
        # running GPU time, for the server's recent figures without a summary over thousands of spans: the union of
        # the exact spans, and of every span (the uncertain share is their difference)
        self._exact = RunningUnion()
        self._covered = RunningUnion()
        self._mark = (0.0, 0.0, 0.0)  # (exact seconds, covered seconds, time) when recent_busy_fraction last answered
        self._recent_uncertain = 0.0
        # the loop resolves events each step; summary() may resolve the rest from another thread (a benchmark)
        self._resolve_lock = threading.Lock()
        if enabled:
            self.enable()

    # ---- switching -----------------------------------------------------------------------------
    def enable(self) -> None:
        self.spans.clear()
        self._pending_gpu.clear()
        self._step = 0
        self._exact, self._covered = RunningUnion(), RunningUnion()
        self._mark = (0.0, 0.0, 0.0)
        self._recent_uncertain = 0.0
        if self.use_cuda:
            self._anchor = torch.cuda.Event(enable_timing=True)
            self._origin = anchored_origin(self._place_anchor, time.perf_counter)
        else:
            self._origin = time.perf_counter()
        self.enabled = True

    def _place_anchor(self) -> None:
        self._anchor.record()
        # why: GPU spans are placed on the host clock relative to this event, so it must have executed
        self._anchor.synchronize()

    def disable(self) -> None:
        self.enabled = False

    # ---- recording -----------------------------------------------------------------------------
    def now(self) -> float:
        return time.perf_counter() - self._origin

    def cpu_span(self, name: str) -> contextlib.AbstractContextManager:
        """A context recording its time as the CPU span `name`; a shared no-op one when disabled. A small class,
        not a generator context: the loop opens five a step."""
        return _CpuSpan(self, name) if self.enabled else _NO_SPAN

    def cpu_span_since(self, name: str, start: float) -> None:
        """Record the CPU span `name` from start (an earlier now()) to now, for work that proves worth a span only
        once it has run."""
        if self.enabled:
            self.spans.append(Span("cpu", name, start, self.now(), self._step))

    def next_step(self) -> None:
        self._step += 1
        if self._pending_gpu:
            with self._resolve_lock:
                self._resolve_finished()

    def gpu_begin(self, name: str, stream, copy: bool = False) -> None:
        """Start the span `name` on stream; copy: its work is a copy, no kernel time (recorded only with
        copy_spans)."""
        if not self.enabled or (copy and not self.copy_spans):
            return
        if self.use_cuda:
            ev = self._event()
            ev.record(stream)  # why: marks when the stream reaches this point, not when the CPU did
            self._open_gpu[name] = (ev, not copy)
        else:
            self._open_gpu[name] = (self.now(), not copy)

    def gpu_end(self, name: str, stream, gap_free: bool = False, idle_s: float | None = 0.0) -> None:
        """End the span `name` on stream, once its work is queued. gap_free: the launcher knows that work holds no
        launch gaps (graph replays, one copy), so the span is exact whatever the GPU's progress. idle_s: seconds
        of idle inside the work (replayed graphs' inner gaps), None when the work holds idle of unknown length
        (the span is then uncertain)."""
        if not self.enabled or name not in self._open_gpu:
            return
        start, kernels = self._open_gpu.pop(name)
        if self.use_cuda:
            # why: a start event the GPU has not executed yet means every launch of the span was queued before the
            # GPU got there, so its kernels run back to back; one already executed means the GPU may have idled
            # between launches. Asked before the end event is recorded, which is the last thing queued.
            exact = (gap_free or not start.query()) and idle_s is not None
            ev = self._event()
            ev.record(stream)  # why: the end of this stream's work for the span
            self._pending_gpu.append((name, start, ev, self._step, exact, idle_s or 0.0, kernels))
        else:
            # exact: the CPU runs the span's work synchronously inside it, so no device sits idle between launches
            self._add_gpu_span(Span("gpu", name, start, self.now(), self._step, kernels=kernels))

    def _add_gpu_span(self, span: Span) -> None:
        self.spans.append(span)
        if not span.kernels:  # a copy: in the picture, not in the busy figures
            return
        if span.exact:
            self._exact.add(span.start, span.end, span.idle)
        self._covered.add(span.start, span.end, span.idle)

    def _resolve_finished(self) -> None:
        """Resolve the oldest pending spans whose steps are behind us, each step a few: spread out, not a burst
        of hundreds of event queries when a summary is asked for. Stops at the first span still running."""
        pending = self._pending_gpu
        while pending and pending[0][3] < self._step - 1 and pending[0][2].query():
            self._resolve_one(*pending.popleft())

    def _resolve_one(self, name: str, s, e, step: int, exact: bool, idle: float, kernels: bool) -> None:
        start, end = self._anchor.elapsed_time(s) / 1e3, self._anchor.elapsed_time(e) / 1e3
        self._add_gpu_span(Span("gpu", name, start, end, step, exact, min(idle, max(0.0, end - start)), kernels))
        self._free_events += (s, e)  # both done (s was recorded before e on the same stream): reusable

    def resolve(self) -> None:
        """Turn every finished GPU event into a span; call after a synchronisation point."""
        with self._resolve_lock:
            still: collections.deque = collections.deque()
            for item in self._pending_gpu:
                if item[2].query():
                    self._resolve_one(*item)
                else:
                    still.append(item)
            self._pending_gpu = still

    def recent_busy_fraction(self) -> float:
        """Share of the wall time since the previous call (or since enable) that exact GPU spans cover, from the
        running totals: O(1), so the engine loop can report it without a summary over the recorded spans. Also
        sets the same window's uncertain share, for recent_uncertain_fraction()."""
        now = self.now()
        exact0, covered0, since = self._mark
        exact, covered = self._exact.total, self._covered.total
        self._mark = (exact, covered, now)
        wall = max(now - since, 1e-9)
        busy = min(1.0, (exact - exact0) / wall)
        # both running unions can read low, each by its own missed gaps: the difference is kept within [0, 1 - busy]
        self._recent_uncertain = min(1.0 - busy, max(0.0, (covered - covered0) - (exact - exact0)) / wall)
        return busy

    def recent_uncertain_fraction(self) -> float:
        """Share of the wall time that uncertain GPU spans cover and exact ones do not, over the window the last
        recent_busy_fraction() call answered for."""
        return self._recent_uncertain

    def _event(self):
        """A timing event, reused once resolved: six a step would otherwise be created and destroyed."""
        return self._free_events.pop() if self._free_events else torch.cuda.Event(enable_timing=True)

    # ---- figures -------------------------------------------------------------------------------
    @property
    def current_step(self) -> int:
        return self._step

    def summary(self) -> dict:
        """GPU busy fraction (exact spans less their idle) and uncertain share over the recorded window, and median
        CPU time per step (wait excluded)."""
        self.resolve()
        spans = self.spans
        gpu = [s for s in spans if s.row == "gpu"]
        cpu = [s for s in spans if s.row == "cpu"]
        if not gpu and not cpu:
            return {"gpu_busy_fraction": 0.0, "gpu_busy_uncertain_fraction": 0.0, "cpu_us_per_step": 0.0,
                    "steps": 0, "wall_s": 0.0}
        start = min([g.start for g in gpu] + [c.start for c in cpu])
        end = max([g.end for g in gpu] + [c.end for c in cpu])
        gpu = [g for g in gpu if g.kernels]  # copies are no kernel time
        exact = [g for g in gpu if g.exact]
        busy = max(0.0, union_length([(g.start, g.end) for g in exact]) - sum(g.idle for g in exact))
        covered = union_length([(g.start, g.end) for g in gpu]) - sum(g.idle for g in exact)
        per_step: dict[int, float] = {}
        by_name: dict[str, list[float]] = {}
        for s in cpu:
            by_name.setdefault(s.name, []).append(s.end - s.start)
            if s.name != "wait":
                per_step[s.step] = per_step.get(s.step, 0.0) + (s.end - s.start)
        wall = max(end - start, 1e-9)
        return {
            "gpu_busy_fraction": busy / wall,
            "gpu_busy_uncertain_fraction": max(0.0, covered - busy) / wall,
            "cpu_us_per_step": statistics.median(per_step.values()) * 1e6 if per_step else 0.0,
            "cpu_us_by_phase": {k: round(statistics.median(v) * 1e6, 1) for k, v in by_name.items()},
            "steps": len(per_step),
            "wall_s": wall,
        }

    def chrome_trace(self, path: str) -> None:
        """Write Chrome-trace / Perfetto JSON: one row for the CPU, one for the GPU."""
        self.resolve()
        events = [
            {"name": s.name, "ph": "X", "pid": 0, "tid": 0 if s.row == "cpu" else 1,
             "ts": s.start * 1e6, "dur": (s.end - s.start) * 1e6,
             "args": ({"step": s.step} if s.row == "cpu"
                      else {"step": s.step, "exact": s.exact, "idle_us": round(s.idle * 1e6, 2)})}
            for s in self.spans
        ]
        events += [{"name": "thread_name", "ph": "M", "pid": 0, "tid": t, "args": {"name": n}}
                   for t, n in ((0, "CPU (engine loop)"), (1, "GPU (streams)"))]
        with open(path, "w") as f:
            json.dump({"traceEvents": events}, f)

    def png(self, path: str, title: str = "", max_steps: int = 12) -> None:
        """Draw a CPU row and a GPU row for the first steps, like the seed article's figure."""
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        self.resolve()
        first = min((s.step for s in self.spans), default=0) + 2  # skip warm-up steps
        spans = [s for s in self.spans if first <= s.step < first + max_steps]
        if not spans:
            return
        t0 = min(s.start for s in spans)
        colors = {"schedule": "#4c72b0", "pack": "#55a868", "launch": "#8172b2", "wait": "#dddddd",
                  "update": "#c44e52", "h2d": "#64b5cd", "compute": "#dd8452", "d2h": "#937860"}
        fig, ax = plt.subplots(figsize=(12, 2.6))
        for s in spans:
            y = 1 if s.row == "cpu" else 0
            ax.broken_barh([((s.start - t0) * 1e3, (s.end - s.start) * 1e3)], (y - 0.35, 0.7),
                           facecolors=colors.get(s.name, "#999999"))
        ax.set_yticks([0, 1], ["GPU", "CPU"])
        ax.set_xlabel("ms")
        handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
        ax.legend(handles, colors.keys(), ncol=8, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, 1.35))
        ax.set_title(title, fontsize=9, pad=28)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
