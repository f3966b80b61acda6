"""Prometheus metrics of one model instance through Triton's Python-backend custom-metrics API."""
from __future__ import annotations

from typing import Any

import triton_python_backend_utils as pb_utils

_TTFT_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
_ITL_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5]
_E2E_BUCKETS = [0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0]
FINISH_REASONS = ("stop", "length", "abort", "error")


def _family(name: str, description: str, kind: Any) -> Any:
    return pb_utils.MetricFamily(name=name, description=description, kind=kind)


class _Distribution:
    """A histogram where the server supports it (Triton ≥ 24.08), else a _sum and a _count counter."""

    def __init__(self, name: str, description: str, labels: dict[str, str], buckets: list[float]):
        try:
            self._families = [_family(name, description, pb_utils.MetricFamily.HISTOGRAM)]
            self._hist = self._families[0].Metric(labels=labels, buckets=buckets)
        except Exception:  # older stub: no HISTOGRAM kind
            self._hist = None
            self._families = [_family(f"{name}_sum", description, pb_utils.MetricFamily.COUNTER),
                              _family(f"{name}_count", description, pb_utils.MetricFamily.COUNTER)]
            self._sum, self._count = (f.Metric(labels=labels) for f in self._families)

    def observe(self, value: float) -> None:
        if self._hist is not None:
            self._hist.observe(value)
        else:
            self._sum.increment(value)
            self._count.increment(1)


class ServingMetrics:
    """Latency distributions, token counters and engine gauges; updated from the sender thread only."""

    def __init__(self, model: str, version: str, instance: str = ""):
        # one series per model instance: instances share a family (same name), and a gauge written by two
        # instances would show whichever wrote last
        labels = {"model": model, "version": version, "instance": instance}
        self.ttft = _Distribution("tandem_time_to_first_token_seconds", "Time to first token", labels, _TTFT_BUCKETS)
        self.itl = _Distribution("tandem_inter_token_latency_seconds", "Time between output tokens", labels,
                                 _ITL_BUCKETS)
        self.e2e = _Distribution("tandem_request_latency_seconds", "Request arrival to final response", labels,
                                 _E2E_BUCKETS)
        counter, gauge = pb_utils.MetricFamily.COUNTER, pb_utils.MetricFamily.GAUGE
        self._families = {
            "prompt": _family("tandem_prompt_tokens_total", "Prompt tokens of finished requests", counter),
            "generation": _family("tandem_generation_tokens_total", "Generated tokens", counter),
            "requests": _family("tandem_requests_total", "Finished requests by finish reason", counter),
            "preemptions": _family("tandem_preemptions_total", "Requests preempted for KV space", counter),
            "running": _family("tandem_num_requests_running", "Requests in the running batch", gauge),
            "waiting": _family("tandem_num_requests_waiting", "Requests waiting to be scheduled", gauge),
            "kv_usage": _family("tandem_kv_cache_usage_ratio", "Share of KV blocks in use (0..1)", gauge),
            "kv_used": _family("tandem_kv_cache_blocks_used", "KV blocks in use", gauge),
            "gpu_busy": _family("tandem_gpu_busy_ratio", "Share of wall time with GPU work queued", gauge),
            "healthy": _family("tandem_engine_healthy", "1 while the engine loop serves, 0 once it stopped", gauge),
        }
        f = self._families
        self.prompt_tokens = f["prompt"].Metric(labels=labels)
        self.generation_tokens = f["generation"].Metric(labels=labels)
        self.finished = {r: f["requests"].Metric(labels={**labels, "finish_reason": r}) for r in FINISH_REASONS}
        self._preemptions = f["preemptions"].Metric(labels=labels)
        gauges = ("running", "waiting", "kv_usage", "kv_used", "gpu_busy", "healthy")
        self._gauges = {k: f[k].Metric(labels=labels) for k in gauges}
        self._preemptions_seen = 0

    def request_finished(self, finish_reason: str | None, num_prompt_tokens: int) -> None:
        self.prompt_tokens.increment(num_prompt_tokens)
        counter = self.finished.get(finish_reason or "error")
        if counter is not None:
            counter.increment(1)

    def update_engine(self, stats: dict[str, Any]) -> None:
        """Copy engine.stats() into the gauges; the engine's preemption total becomes counter increments."""
        used, total = stats.get("kv_blocks_used", 0), stats.get("kv_blocks_total", 0)
        g = self._gauges
        g["running"].set(float(stats.get("running", 0)))
        g["waiting"].set(float(stats.get("waiting", 0)))
        g["kv_used"].set(float(used))
        g["kv_usage"].set(used / total if total else 0.0)
        g["gpu_busy"].set(float(stats.get("gpu_busy_fraction", 0.0) or 0.0))
        g["healthy"].set(1.0 if stats.get("healthy", True) else 0.0)
        preemptions = int(stats.get("num_preemptions", stats.get("preemptions", 0)) or 0)
        if preemptions > self._preemptions_seen:
            self._preemptions.increment(preemptions - self._preemptions_seen)
            self._preemptions_seen = preemptions
