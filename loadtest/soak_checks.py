"""Soak-test measurements: resident memory of the Python-backend stub over time, its growth, and the pass criteria."""
from __future__ import annotations

import csv
import math
import statistics
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from loadtest.server_metrics import ServerMetrics


def rss_kb(pid: int) -> int | None:
    """VmRSS of a live process in kB; None once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


@dataclass(slots=True)
class Sample:
    """One tick of the sampler: seconds since the load started, stub and server RSS, the engine's gauges."""

    t: float
    stub_rss_kb: int | None
    server_rss_kb: int | None
    running: float | None = None
    waiting: float | None = None
    kv_blocks_used: float | None = None
    generation_tokens: float | None = None


class ResourceSampler:
    """A thread that samples RSS (from /proc) and the metrics endpoint every `interval` seconds."""

    def __init__(self, stub_pids, server_pid: int | None, metrics: ServerMetrics, interval: float = 5.0):
        self._stub_pids, self._server_pid = stub_pids, server_pid  # stub_pids: a callable (stubs may restart)
        self._metrics, self._interval = metrics, interval
        self.samples: list[Sample] = []
        self.pids_seen: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-sampler", daemon=True)
        self._t0 = 0.0

    def start(self) -> None:
        self._t0 = time.monotonic()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(self._interval + 10)

    def _run(self) -> None:
        while True:
            self.samples.append(self._sample())
            if self._stop.wait(self._interval):
                self.samples.append(self._sample())  # one at the very end of the load
                return

    def _sample(self) -> Sample:
        pids = self._stub_pids()
        self.pids_seen.update(pids)
        sizes = [kb for kb in map(rss_kb, pids) if kb is not None]
        server = rss_kb(self._server_pid) if self._server_pid else None
        sample = Sample(round(time.monotonic() - self._t0, 2), sum(sizes) if sizes else None, server)
        try:
            snap = self._metrics.snapshot()
        except OSError:
            return sample  # the endpoint did not answer this tick; the end-state check will tell
        sample.running, sample.waiting = snap["running"], snap["waiting"]
        sample.kv_blocks_used, sample.generation_tokens = snap["kv_blocks_used"], snap["generation_tokens"]
        return sample

    def write_csv(self, path: Path) -> None:
        with path.open("w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=list(Sample.__slots__))
            writer.writeheader()
            writer.writerows(asdict(s) for s in self.samples)


def rss_growth(samples: list[Sample], warmup_s: float, window_s: float) -> dict:
    """Stub RSS right after warm-up vs at the end of the load, as the floor (10th percentile) of a window each.

    Each step allocates and frees large activations, so single ticks swing by hundreds of MB; what a leak
    raises is the floor that remains between steps. Warm-up covers what grows once and then stays (allocator
    pools at peak batch size, caches).
    """
    points = [(s.t, s.stub_rss_kb) for s in samples if s.stub_rss_kb is not None]
    if not points:
        return {"measured": False, "reason": "no triton_python_backend_stub process found to sample"}
    end_t = points[-1][0]
    base = [kb for t, kb in points if warmup_s <= t <= warmup_s + window_s]
    tail = [kb for t, kb in points if t >= end_t - window_s and t > warmup_s + window_s]
    if len(base) < 3 or len(tail) < 3:
        return {"measured": False, "reason": f"run too short: {end_t:.0f} s for a {warmup_s:.0f} s warm-up and two "
                                             f"{window_s:.0f} s windows of 3+ samples"}
    warm, end = _p10(base), _p10(tail)
    return {
        "measured": True, "warmup_s": warmup_s, "window_s": window_s, "samples": len(points),
        "start_mb": points[0][1] / 1024, "after_warmup_mb": warm / 1024, "end_mb": end / 1024,
        "after_warmup_median_mb": statistics.median(base) / 1024, "end_median_mb": statistics.median(tail) / 1024,
        "peak_mb": max(kb for _, kb in points) / 1024, "growth_pct": (end - warm) / warm * 100.0,
    }


def _p10(values: list[int]) -> float:
    return statistics.quantiles(values, n=10, method="inclusive")[0]


def criterion(passed: bool | None, measured, target) -> dict:
    return {"passed": None if passed is None else bool(passed), "measured": measured, "target": target}


def criteria(summary: dict, max_rss_growth_pct: float, rss_optional: bool = False) -> dict[str, dict]:
    """Every soak criterion: target, what was measured, passed (None: skipped, an unmeasurable optional one)."""
    counts, rss, end = summary["counts"], summary["rss"], summary["end_state"]
    growth = rss.get("growth_pct")
    rss_passed = None if growth is None and rss_optional else growth is not None and growth < max_rss_growth_pct
    return {
        "no_unexpected_failures": criterion(summary["failures"]["count"] == 0, summary["failures"]["count"], 0),
        "normal_requests_completed": criterion(counts["normal"] > 0, counts["normal"], "> 0"),
        "cancels_exercised": criterion(counts["cancelled"] > 0, counts["cancelled"], "> 0"),
        "bad_inputs_refused": criterion(counts["bad_input_refused"] > 0, counts["bad_input_refused"], "> 0"),
        "stub_rss_growth_pct": criterion(rss_passed, growth, f"< {max_rss_growth_pct}"),
        # a second stub pid means the stub died and Triton restarted it, losing every request in flight
        "stub_never_restarted": criterion(None if rss_optional and not summary["stub_pids"] else
                                          len(summary["stub_pids"]) == 1, summary["stub_pids"], "one stub pid"),
        "idle_at_end": criterion(end["idle_after_s"] is not None, end["idle_after_s"], "running = waiting = 0"),
        "kv_blocks_used_at_end": criterion(end["kv_blocks_used"] == 0, end["kv_blocks_used"], 0),
        "server_ready_at_end": criterion(summary["health"]["ready"], summary["health"], "ready, answers"),
    }


def rss_chart(samples: list[Sample], warmup_s: float, path: Path, growth: dict | None = None) -> Path | None:
    """Stub RSS and KV blocks in use over the run, with the end of warm-up marked and the growth in the title."""
    from loadtest.charts import headroom, plt  # the Agg backend, set up once there

    points = [(s.t, s.stub_rss_kb / 1024, s.kv_blocks_used) for s in samples if s.stub_rss_kb is not None]
    if len(points) < 2:
        return None
    t, mb, kv = zip(*points)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.plot(t, mb, label="stub RSS (MiB)")
    ax.axvline(warmup_s, color="grey", linestyle=":", label="end of warm-up")
    ax.set_xlabel("seconds")
    ax.set_ylabel("MiB")
    ax.set_ylim(0, headroom(mb))  # from 0: the growth figure in the title is the measure, not the slope
    kv_ax = ax.twinx()
    kv = [math.nan if k is None else k for k in kv]  # the metrics endpoint did not answer: a gap, not 0
    kv_ax.plot(t, kv, color="tab:orange", alpha=0.6, label="KV blocks used")
    kv_ax.set_ylabel("KV blocks used")
    kv_ax.set_ylim(0, headroom(kv))
    title = "Python-backend stub RSS and KV blocks in use"
    if growth and growth.get("measured"):
        title += (f"\nRSS floor after warm-up {growth['after_warmup_mb']:.1f} MiB, at the end {growth['end_mb']:.1f}"
                  f" MiB ({growth['growth_pct']:+.2f}%)")
    ax.set_title(title, fontsize=10)
    fig.legend(loc="lower center", ncol=3, fontsize=8)
    fig.tight_layout(rect=(0, 0.07, 1, 1))  # room for the legend under the axes
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
