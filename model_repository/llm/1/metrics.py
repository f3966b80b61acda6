"""Prometheus metrics of one model instance through Triton's Python-backend custom-metrics API."""
from __future__ import annotations

import bisect
import threading
from typing import Any

import triton_python_backend_utils as pb_utils

_TTFT_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
_ITL_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5]
_E2E_BUCKETS = [0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0]
FINISH_REASONS = ("stop", "length", "abort", "error")
# the Triton error codes the model answers with (model.py, sender.py): their series exist from the start, at 0
ERROR_CODES = ("INVALID_ARG", "UNAVAILABLE", "INTERNAL")
_TRITON_ERROR_CODES = ("UNKNOWN", "INTERNAL", "NOT_FOUND", "INVALID_ARG", "UNAVAILABLE", "UNSUPPORTED",
                       "ALREADY_EXISTS", "CANCELLED")
# the vLLM backend's buckets for its vllm:* series (REPORT_CUSTOM_METRICS), so dashboards built on them line up
_VLLM_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0]
_VLLM_TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5]
_VLLM_E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                     480.0, 960.0, 1920.0, 7680.0]
_VLLM_N_BUCKETS = [1, 2, 5, 10, 20]


def _family(name: str, description: str, kind: Any) -> Any:
    return pb_utils.MetricFamily(name=name, description=description, kind=kind)


class _Distribution:
    """A latency histogram counted in the stub and sent to Triton at each flush, as Prometheus histogram series
    (`_bucket` with `le`, `_sum`, `_count`). Every call of a Triton metric is an IPC round trip from the stub to
    the server: a native histogram's observe() per streamed token made the sender thread do thousands a second."""

    def __init__(self, name: str, description: str, labels: dict[str, str], buckets: list[float]):
        counter = pb_utils.MetricFamily.COUNTER
        self._bounds = list(buckets)
        self._families = [_family(f"{name}_bucket", description, counter), _family(f"{name}_sum", description, counter),
                          _family(f"{name}_count", description, counter)]
        les = [repr(float(b)) for b in self._bounds] + ["+Inf"]
        self._bucket_metrics = [self._families[0].Metric(labels={**labels, "le": le}) for le in les]
        self._sum_metric = self._families[1].Metric(labels=labels)
        self._count_metric = self._families[2].Metric(labels=labels)
        self._pending = [0] * len(les)  # observations per bucket since the last flush (not cumulative)
        self._pending_sum = 0.0

    def observe(self, value: float, count: int = 1) -> None:
        self._pending[bisect.bisect_left(self._bounds, value)] += count
        self._pending_sum += value * count

    def flush(self) -> None:
        total = sum(self._pending)
        if not total:
            return
        cumulative = 0
        for metric, n in zip(self._bucket_metrics, self._pending):
            cumulative += n
            if cumulative:  # bucket le=x counts every observation <= x
                metric.increment(cumulative)
        self._sum_metric.increment(self._pending_sum)
        self._count_metric.increment(total)
        self._pending = [0] * len(self._pending)
        self._pending_sum = 0.0


class _Counter:
    """A counter added up in the stub and sent to Triton at each flush (one IPC round trip per flush)."""

    def __init__(self, metric: Any):
        self._metric = metric
        self._pending = 0.0

    def increment(self, value: float) -> None:
        self._pending += value

    def flush(self) -> None:
        if self._pending:
            self._metric.increment(self._pending)
            self._pending = 0.0


class _CodeCounter:
    """Error responses per Triton error code, counted from any thread and sent to Triton at each flush.

    Both the execute thread (refusals in model.py) and the sender thread count here, so the pending counts sit
    behind a lock: `pending[code] += 1` is a read then a write, and a thread switch between the two would lose the
    other thread's count. A lock rather than a queue: an addition under it takes nanoseconds, it is never held
    across a metric call (an IPC round trip), and flush() takes everything pending in one swap. flush() is called
    from the sender thread only, so a code not seen before gets its Metric there."""

    def __init__(self, family: Any, labels: dict[str, str], codes: tuple[str, ...]):
        self._family, self._labels = family, labels
        self._metrics = {code: family.Metric(labels={**labels, "code": code}) for code in codes}
        self._lock = threading.Lock()
        self._pending: dict[str, int] = {}

    def increment(self, code: str, value: int = 1) -> None:
        with self._lock:
            self._pending[code] = self._pending.get(code, 0) + value

    def flush(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
        for code, value in pending.items():
            metric = self._metrics.get(code)
            if metric is None:
                metric = self._metrics[code] = self._family.Metric(labels={**self._labels, "code": code})
            metric.increment(value)


def error_code_name(code: Any) -> str:
    """A pb_utils.TritonError code's name (INVALID_ARG, UNAVAILABLE, ...): the `code` label's value."""
    if isinstance(code, str):
        return code
    name = getattr(code, "name", None)  # the stub's codes are a pybind11 enum
    if isinstance(name, str) and name:
        return name
    for candidate in _TRITON_ERROR_CODES:
        if getattr(pb_utils.TritonError, candidate, None) == code:
            return candidate
    return str(code)


class _Fanout:
    """Several distributions or counters fed as one: Tandem's series and, where asked, the vLLM-named ones."""

    def __init__(self, *items: Any):
        self._items = items

    def observe(self, value: float, count: int = 1) -> None:
        for item in self._items:
            item.observe(value, count)

    def increment(self, value: float) -> None:
        for item in self._items:
            item.increment(value)

    def flush(self) -> None:
        for item in self._items:
            item.flush()


def _1_2_5_buckets(limit: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to limit: vLLM's buckets for token counts."""
    buckets, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return buckets
            buckets.append(float(m * scale))
        scale *= 10


class _VllmSeries:
    """The vllm:* series of Triton's vLLM backend (its REPORT_CUSTOM_METRICS), fed from the same observations."""

    def __init__(self, labels: dict[str, str], max_model_len: int):
        counter, gauge = pb_utils.MetricFamily.COUNTER, pb_utils.MetricFamily.GAUGE
        self.ttft = _Distribution("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                                  labels, _VLLM_TTFT_BUCKETS)
        self.tpot = _Distribution("vllm:time_per_output_token_seconds",
                                  "Histogram of time per output token in seconds.", labels, _VLLM_TPOT_BUCKETS)
        self.e2e = _Distribution("vllm:e2e_request_latency_seconds",
                                 "Histogram of end to end request latency in seconds.", labels, _VLLM_E2E_BUCKETS)
        tokens = _1_2_5_buckets(max_model_len)
        self.request_prompt_tokens = _Distribution("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                                   labels, tokens)
        self.request_generation_tokens = _Distribution("vllm:request_generation_tokens",
                                                       "Number of generation tokens processed.", labels, tokens)
        self.request_n = _Distribution("vllm:request_params_n", "Histogram of the n request parameter.", labels,
                                       _VLLM_N_BUCKETS)
        families = {
            "prompt": _family("vllm:prompt_tokens_total", "Number of prefill tokens processed.", counter),
            "generation": _family("vllm:generation_tokens_total", "Number of generation tokens processed.", counter),
            "preemptions": _family("vllm:num_preemptions_total", "Number of preemption tokens processed.", counter),
            "running": _family("vllm:num_requests_running", "Number of requests currently running on GPU.", gauge),
            "waiting": _family("vllm:num_requests_waiting", "Number of requests waiting to be processed.", gauge),
            "kv_usage": _family("vllm:gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage.", gauge),
        }
        self._families = families  # a family dropped by Python is dropped by Triton, with its series
        self.prompt_tokens = _Counter(families["prompt"].Metric(labels=labels))
        self.generation_tokens = _Counter(families["generation"].Metric(labels=labels))
        self.preemptions = families["preemptions"].Metric(labels=labels)
        self.gauges = {k: families[k].Metric(labels=labels) for k in ("running", "waiting", "kv_usage")}

    def request_finished(self, num_prompt_tokens: int, num_output_tokens: int, n: int) -> None:
        self.request_prompt_tokens.observe(num_prompt_tokens)
        self.request_generation_tokens.observe(num_output_tokens)
        self.request_n.observe(n)

    def flush(self) -> None:
        for item in (self.request_prompt_tokens, self.request_generation_tokens, self.request_n):
            item.flush()


# engine.stats() key -> (Tandem's series, vLLM's series, description)
_SPEC_TOTALS = {
    "spec_drafts": ("tandem_spec_decode_drafts_total", "vllm:spec_decode_num_drafts_total",
                    "Drafted spans verified (one per speculating row and step)"),
    "spec_proposed_tokens": ("tandem_spec_decode_draft_tokens_total", "vllm:spec_decode_num_draft_tokens_total",
                             "Draft tokens proposed and verified"),
    "spec_accepted_tokens": ("tandem_spec_decode_accepted_tokens_total",
                             "vllm:spec_decode_num_accepted_tokens_total", "Draft tokens accepted"),
}
_SPEC_PER_POSITION = ("tandem_spec_decode_accepted_tokens_per_position_total",
                 "vllm:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by position in the draft")


class SpeculationMetrics:
    """Turns the engine's running speculation totals (engine.stats()) into counter increments."""

    def __init__(self, labels: dict[str, str], with_vllm: bool) -> None:
        counter = pb_utils.MetricFamily.COUNTER
        names = [(ours, theirs if with_vllm else None, text) for ours, theirs, text in (*_SPEC_TOTALS.values(),
                                                                                          _SPEC_PER_POSITION)]
        # a family dropped by Python is dropped by Triton, with its series: kept here
        self._families = [[pb_utils.MetricFamily(name=n, description=text, kind=counter) for n in (ours, theirs) if n]
                          for ours, theirs, text in names]
        self._labels = labels
        self._totals = {key: [f.Metric(labels=labels) for f in families]
                        for key, families in zip(_SPEC_TOTALS, self._families)}
        self._positions: list[list[Any]] = []
        self._seen: dict[str, int] = {}
        self._seen_positions: list[int] = []

    def update(self, stats: dict[str, Any]) -> None:
        """Add what each total grew by since the last update."""
        for key, metrics in self._totals.items():
            grown = int(stats.get(key, 0)) - self._seen.get(key, 0)
            if grown > 0:
                for metric in metrics:
                    metric.increment(grown)
                self._seen[key] = self._seen.get(key, 0) + grown
        per_position = stats.get("spec_accepted_per_position") or []
        while len(self._positions) < len(per_position):
            labels = {**self._labels, "position": str(len(self._positions))}
            self._positions.append([f.Metric(labels=labels) for f in self._families[-1]])
            self._seen_positions.append(0)
        for position, total in enumerate(per_position):
            grown = int(total) - self._seen_positions[position]
            if grown > 0:
                for metric in self._positions[position]:
                    metric.increment(grown)
                self._seen_positions[position] = int(total)


def _serving_families() -> dict[str, Any]:
    """The metric families ServingMetrics reports in, by its own short names."""
    counter, gauge = pb_utils.MetricFamily.COUNTER, pb_utils.MetricFamily.GAUGE
    return {
        "prompt": _family("tandem_prompt_tokens_total", "Prompt tokens of finished requests", counter),
        "generation": _family("tandem_generation_tokens_total", "Generated tokens", counter),
        "requests": _family("tandem_requests_total", "Finished requests by finish reason", counter),
        "errors": _family("tandem_request_errors_total",
                          "Final error responses sent to clients, by Triton error code", counter),
        "preemptions": _family("tandem_preemptions_total", "Requests preempted for KV space", counter),
        "running": _family("tandem_num_requests_running", "Requests in the running batch", gauge),
        "waiting": _family("tandem_num_requests_waiting", "Requests waiting to be scheduled", gauge),
        "kv_usage": _family("tandem_kv_cache_usage_ratio", "Share of KV blocks in use (0..1)", gauge),
        "kv_used": _family("tandem_kv_cache_blocks_used", "KV blocks in use", gauge),
        "gpu_busy": _family("tandem_gpu_busy_ratio",
                            "Share of wall time the GPU was busy, from spans known to hold no launch gaps", gauge),
        "gpu_busy_uncertain": _family("tandem_gpu_busy_uncertain_ratio",
                                      "Share of wall time covered by eagerly launched GPU spans whose kernel time "
                                      "the timeline cannot know", gauge),
        "healthy": _family("tandem_engine_healthy", "1 while the engine loop serves, 0 once it stopped", gauge),
    }


class ServingMetrics:
    """Latency distributions, token counters and engine gauges; updated from the sender thread only, except
    request_error() (any thread: see _CodeCounter). Counters and distributions reach Triton at flush(); gauges are
    set at each update_engine()."""

    def __init__(self, model: str, version: str, instance: str = "", vllm_max_model_len: int | None = None):
        """vllm_max_model_len: also report the vLLM backend's vllm:* series (token-count buckets up to it)."""
        # one series per model instance: instances share a family (same name), and a gauge written by two
        # instances would show whichever wrote last
        labels = {"model": model, "version": version, "instance": instance}
        self.vllm = _VllmSeries(labels, vllm_max_model_len) if vllm_max_model_len else None
        ttft = _Distribution("tandem_time_to_first_token_seconds", "Time to first token", labels, _TTFT_BUCKETS)
        itl = _Distribution("tandem_inter_token_latency_seconds", "Time between output tokens", labels, _ITL_BUCKETS)
        e2e = _Distribution("tandem_request_latency_seconds", "Request arrival to final response", labels,
                            _E2E_BUCKETS)
        self._families = _serving_families()
        f = self._families
        prompt_tokens = _Counter(f["prompt"].Metric(labels=labels))
        generation_tokens = _Counter(f["generation"].Metric(labels=labels))
        v = self.vllm
        pairs = ((ttft, v and v.ttft), (itl, v and v.tpot), (e2e, v and v.e2e), (prompt_tokens, v and v.prompt_tokens),
                 (generation_tokens, v and v.generation_tokens))
        self.ttft, self.itl, self.e2e, self.prompt_tokens, self.generation_tokens = (
            _Fanout(ours, theirs) if theirs else ours for ours, theirs in pairs)
        self.finished = {r: _Counter(f["requests"].Metric(labels={**labels, "finish_reason": r}))
                         for r in FINISH_REASONS}
        self.errors = _CodeCounter(f["errors"], labels, ERROR_CODES)
        self._preemptions = f["preemptions"].Metric(labels=labels)
        gauges = ("running", "waiting", "kv_usage", "kv_used", "gpu_busy", "gpu_busy_uncertain", "healthy")
        self._gauges = {k: f[k].Metric(labels=labels) for k in gauges}
        self._preemptions_seen = 0
        self._labels = labels
        self._speculation: SpeculationMetrics | None = None  # made at the first stats of a speculating engine

    def request_finished(self, finish_reason: str | None, num_prompt_tokens: int, num_output_tokens: int = 0,
                         n: int = 1) -> None:
        """One request's end; num_output_tokens over all of its n samples (the prompt counts once)."""
        self.prompt_tokens.increment(num_prompt_tokens)
        if self.vllm is not None:
            self.vllm.request_finished(num_prompt_tokens, num_output_tokens, n)
        counter = self.finished.get(finish_reason or "error")
        if counter is not None:
            counter.increment(1)

    def request_error(self, code: Any) -> None:
        """One final error response sent to a client (any thread); code: a pb_utils.TritonError code or its name."""
        self.errors.increment(error_code_name(code))

    def flush(self) -> None:
        """Send what the counters and distributions gathered since the last flush."""
        for item in (self.ttft, self.itl, self.e2e, self.prompt_tokens, self.generation_tokens,
                     *self.finished.values(), self.errors):
            item.flush()
        if self.vllm is not None:
            self.vllm.flush()

    def update_engine(self, stats: dict[str, Any]) -> None:
        """Copy engine.stats() into the gauges; the engine's preemption total becomes counter increments."""
        used, total = stats.get("kv_blocks_used", 0), stats.get("kv_blocks_total", 0)
        g = self._gauges
        g["running"].set(float(stats.get("running", 0)))
        g["waiting"].set(float(stats.get("waiting", 0)))
        g["kv_used"].set(float(used))
        g["kv_usage"].set(used / total if total else 0.0)
        g["gpu_busy"].set(float(stats.get("gpu_busy_fraction", 0.0) or 0.0))
        g["gpu_busy_uncertain"].set(float(stats.get("gpu_busy_uncertain_fraction", 0.0) or 0.0))
        g["healthy"].set(1.0 if stats.get("healthy", True) else 0.0)
        if self.vllm is not None:
            self.vllm.gauges["running"].set(float(stats.get("running", 0)))
            self.vllm.gauges["waiting"].set(float(stats.get("waiting", 0)))
            self.vllm.gauges["kv_usage"].set(used / total if total else 0.0)
        preemptions = int(stats.get("num_preemptions", stats.get("preemptions", 0)) or 0)
        if preemptions > self._preemptions_seen:
            self._preemptions.increment(preemptions - self._preemptions_seen)
            if self.vllm is not None:
                self.vllm.preemptions.increment(preemptions - self._preemptions_seen)
            self._preemptions_seen = preemptions
        if "spec_drafts" in stats:
            if self._speculation is None:
                self._speculation = SpeculationMetrics(self._labels, with_vllm=self.vllm is not None)
            self._speculation.update(stats)
