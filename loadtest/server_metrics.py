"""Read the Tandem model's Prometheus metrics (running/waiting, KV blocks, token counters) from Triton."""
from __future__ import annotations

import re
import time
import urllib.request

RUNNING, WAITING = "tandem_num_requests_running", "tandem_num_requests_waiting"
KV_USED, KV_USAGE = "tandem_kv_cache_blocks_used", "tandem_kv_cache_usage_ratio"
GENERATED = "tandem_generation_tokens_total"
FINISHED = "tandem_requests_total"  # labelled by finish_reason
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{([^}]*)\})? ([0-9.eE+-]+|NaN|[+-]Inf)$", re.M)
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


class ServerMetrics:
    """One model's samples from Triton's metrics endpoint; values summed over the labels not asked for."""

    def __init__(self, url: str, model: str = "llm", timeout: float = 5.0):
        self.url, self.model, self.timeout = url, model, timeout

    def scrape(self) -> list[tuple[str, dict[str, str], float]]:
        with urllib.request.urlopen(self.url, timeout=self.timeout) as resp:
            text = resp.read().decode()
        out = []
        for name, labels, value in _SAMPLE.findall(text):
            label_map = dict(_LABEL.findall(labels or ""))
            if label_map.get("model", self.model) == self.model:
                out.append((name, label_map, float(value)))
        return out

    def values(self, **match: str) -> dict[str, float]:
        """Every metric name → its summed value (samples whose labels include `match`)."""
        totals: dict[str, float] = {}
        for name, labels, value in self.scrape():
            if all(labels.get(k) == v for k, v in match.items()):
                totals[name] = totals.get(name, 0.0) + value
        return totals

    def get(self, name: str, **match: str) -> float:
        return self.values(**match).get(name, 0.0)

    def finished(self) -> dict[str, float]:
        """tandem_requests_total per finish reason."""
        return {labels["finish_reason"]: value for name, labels, value in self.scrape()
                if name == FINISHED and "finish_reason" in labels}

    def snapshot(self) -> dict[str, float]:
        """The figures a robustness check watches: requests in flight, KV blocks, generated tokens."""
        v = self.values()
        return {"running": v.get(RUNNING, 0.0), "waiting": v.get(WAITING, 0.0), "kv_blocks_used": v.get(KV_USED, 0.0),
                "kv_usage": v.get(KV_USAGE, 0.0), "generation_tokens": v.get(GENERATED, 0.0)}

    def wait_idle(self, timeout: float, poll_s: float = 0.1) -> tuple[float | None, dict[str, float]]:
        """Poll until nothing runs, waits or holds KV blocks; (seconds it took or None on timeout, last snapshot).

        The gauges refresh on the adapter's stats interval, so one read proves nothing: poll.
        """
        start = time.monotonic()
        while True:
            snap = self.snapshot()
            if snap["running"] == 0 and snap["waiting"] == 0 and snap["kv_blocks_used"] == 0:
                return time.monotonic() - start, snap
            if time.monotonic() - start > timeout:
                return None, snap
            time.sleep(poll_s)
