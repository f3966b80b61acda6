"""Sample the server's own Tandem metrics while a load test runs: GPU busy, KV usage, queue, tokens generated."""
from __future__ import annotations

import statistics
import threading
import time

from loadtest.server_metrics import GENERATED, KV_USAGE, RUNNING, WAITING, ServerMetrics

GPU_BUSY = "tandem_gpu_busy_ratio"
PREEMPTIONS = "tandem_preemptions_total"
_GAUGES = {"gpu_busy_ratio": GPU_BUSY, "kv_cache_usage_ratio": KV_USAGE, "running": RUNNING, "waiting": WAITING}
_RATIOS = (GPU_BUSY, KV_USAGE)


def combine(samples: list[tuple[str, dict[str, str], float]]) -> dict[str, float]:
    """One value per metric over its series (model instances, finish reasons): ratios are averaged, the rest
    (counts, tokens, requests) added up."""
    totals: dict[str, list[float]] = {}
    for name, _labels, value in samples:
        totals.setdefault(name, []).append(value)
    return {name: statistics.fmean(v) if name in _RATIOS else sum(v) for name, v in totals.items()}


class ServerWatch:
    """A thread that scrapes the metrics endpoint every `interval_s`; summary() gives deltas and gauge statistics."""

    def __init__(self, url: str, model: str, interval_s: float = 1.0) -> None:
        self.metrics = ServerMetrics(url, model)
        self.interval_s = interval_s
        self.samples: list[dict[str, float]] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="server-watch", daemon=True)

    def start(self) -> "ServerWatch":
        self._scrape()  # the counters' starting point
        self._thread.start()
        return self

    def stop(self, settle_s: float = 2.0, poll_s: float = 0.25) -> dict:
        """The counters' end point once the token counter stops moving (at most settle_s): the server adds up its
        counters in the model and sends them to Triton on a timer, so the tokens of the last responses a client
        saw can reach the endpoint a moment after the run ends."""
        self._stop.set()
        self._thread.join(timeout=10 * self.interval_s + 10)
        self._scrape()
        deadline = time.monotonic() + settle_s
        while time.monotonic() < deadline:
            before = self.samples[-1].get(GENERATED) if self.samples else None
            time.sleep(poll_s)
            self._scrape()
            if before is not None and self.samples[-1].get(GENERATED) == before:
                break
        return self.summary()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._scrape()

    def _scrape(self) -> None:
        try:
            self.samples.append(combine(self.metrics.scrape()))
        except Exception as err:  # the load test goes on without server figures
            self.errors.append(f"{type(err).__name__}: {err}")

    def summary(self) -> dict:
        """Counters as end − start; each gauge's mean and max over the samples (absent metrics are left out)."""
        if len(self.samples) < 2:
            return {"error": self.errors[-1] if self.errors else "fewer than two samples of the metrics endpoint"}
        first, last = self.samples[0], self.samples[-1]
        out: dict = {"samples": len(self.samples)}
        for key, name in (("generated_tokens", GENERATED), ("preemptions", PREEMPTIONS)):
            if name in last:
                out[key] = last[name] - first.get(name, 0.0)
        for key, name in _GAUGES.items():
            values = [s[name] for s in self.samples[1:-1] if name in s] or [s[name] for s in self.samples if name in s]
            if values:
                out[key] = {"mean": round(statistics.fmean(values), 4), "max": round(max(values), 4)}
        if self.errors:
            out["scrape_errors"] = len(self.errors)
        return out
