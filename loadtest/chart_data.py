"""The numbers the charts plot, from the samples file: rates per time bin, percentiles per bin with gaps, counts.

Every function here returns plain lists, so a test can check what a chart shows without looking at pixels.
A bin with no measurement holds NaN (matplotlib leaves a gap), never 0.
"""
from __future__ import annotations

import bisect
import math

import numpy as np

NICE_BINS_S = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600)
MAX_BINS = 60  # enough points for a trend
PER_BIN = 5  # requests a bin should hold on average: a rate or a p95 from one or two is noise
MIN_LAST_BIN = 0.5  # a last bin shorter than this share of bin_s joins the one before: a few requests over a
# sliver of a second would read as a spike


def bin_seconds(span_s: float, events: int | None = None) -> float:
    """The smallest of NICE_BINS_S that cuts `span_s` into at most MAX_BINS bins, each holding PER_BIN of the
    `events` on average (1 s for a minute's run with enough requests)."""
    for b in NICE_BINS_S:
        if span_s / b <= MAX_BINS and (not events or events * b >= PER_BIN * span_s):
            return float(b)
    return float(NICE_BINS_S[-1])


def completed(samples: list[dict]) -> list[dict]:
    """Requests that ran to their end: neither failed nor cut off by the end of the run."""
    return [s for s in samples if "error" not in s and not s.get("stopped")]


def end_time(s: dict) -> float:
    """When the request ended: its last response, or for one cut off by the stop, the stop itself."""
    return s["start"] + max(s["e2e_ms"], s.get("stopped_ms") or 0.0) / 1000.0


class Bins:
    """Time bins from t0 (the first request) to the end of the run, each bin_s long but the last: that one ends
    with the run, and joins the one before when shorter than MIN_LAST_BIN of a bin."""

    def __init__(self, samples: list[dict], bin_s: float | None = None, per_request: bool = True,
                 run: tuple[float, float] | None = None):
        """bin_s None: chosen from the span (and, per_request, the number of requests, PER_BIN in each).
        run: (start, end) of the run as Locust saw it, widening the span the samples give (users that wait out a
        back-off leave no sample at the stop)."""
        starts, ends = [s["start"] for s in samples], [end_time(s) for s in samples]
        if run is not None:
            starts, ends = starts + [run[0]], ends + [run[1]]
        self.t0 = min(starts, default=0.0)
        self.span = max(ends, default=self.t0) - self.t0
        ended = sum(1 for s in samples if not s.get("stopped")) if per_request else None
        self.bin_s = bin_seconds(self.span, ended) if bin_s is None else bin_s
        self.edges = [i * self.bin_s for i in range(int(self.span // self.bin_s) + 1)] + [self.span]
        if len(self.edges) > 2 and self.edges[-1] - self.edges[-2] < MIN_LAST_BIN * self.bin_s:
            del self.edges[-2]
        if self.edges[-1] <= self.edges[-2]:  # a span of whole bins (or of nothing)
            self.edges[-1] = self.edges[-2] + self.bin_s
        self.widths = [b - a for a, b in zip(self.edges, self.edges[1:])]

    def __len__(self) -> int:
        return len(self.widths)

    def index(self, t_unix: float) -> int | None:
        """The bin holding time t_unix (the run's very end belongs to the last one); None outside the run."""
        t = t_unix - self.t0
        if t < 0 or t > self.edges[-1]:
            return None
        return min(bisect.bisect_right(self.edges, t) - 1, len(self) - 1)

    def centres(self) -> list[float]:
        return [(a + b) / 2 for a, b in zip(self.edges, self.edges[1:])]


def requests_per_second(samples: list[dict], bins: Bins) -> tuple[list[float], list[float], list[float]]:
    """(bin centres, completed requests/s, failed requests/s), each request counted in the bin where it ended."""
    done, failed = [0] * len(bins), [0] * len(bins)
    for s in samples:
        if s.get("stopped"):
            continue
        i = bins.index(end_time(s))
        if i is not None:
            (failed if "error" in s else done)[i] += 1
    return (bins.centres(), [c / w for c, w in zip(done, bins.widths)],
            [c / w for c, w in zip(failed, bins.widths)])


def generated_per_second(samples: list[dict], bins: Bins) -> tuple[list[float], list[float]]:
    """(bin centres, output tokens/s as generated): each request's tokens spread evenly from its first token to its
    end, those cut off by the end of the run included (a request's tokens counted at its completion make waves of
    equal requests look like spikes, and would drop what was in flight at the stop)."""
    totals = [0.0] * len(bins)
    for s in samples:
        if "error" in s or not s.get("output_tokens") or s.get("ttft_ms") is None:
            continue
        first = s["start"] + s["ttft_ms"] / 1000.0 - bins.t0
        last = s["start"] + s["e2e_ms"] / 1000.0 - bins.t0  # its last token (for one cut off: not the stop)
        if last - first < 1e-9:  # one response: all its tokens in one bin
            i = bins.index(bins.t0 + first)
            if i is not None:
                totals[i] += s["output_tokens"]
            continue
        rate = s["output_tokens"] / (last - first)
        for i, (a, b) in enumerate(zip(bins.edges, bins.edges[1:])):
            totals[i] += rate * max(min(last, b) - max(first, a), 0.0)
    return bins.centres(), [t / w for t, w in zip(totals, bins.widths)]


def latency_per_bin(samples: list[dict], bins: Bins, metric: str) -> dict[str, list[float]]:
    """p50 and p95 of `metric` over the completed requests measured in each bin (TTFT when the first token came,
    ITL and e2e when the request ended), with the count behind each; NaN where a bin has none."""
    values: list[list[float]] = [[] for _ in range(len(bins))]
    for s in completed(samples):
        if s.get(metric) is None:
            continue
        at = s["start"] + s["ttft_ms"] / 1000.0 if metric == "ttft_ms" else end_time(s)
        i = bins.index(at)
        if i is not None:
            values[i].append(s[metric])
    p50 = [float(np.percentile(v, 50)) if v else math.nan for v in values]
    p95 = [float(np.percentile(v, 95)) if v else math.nan for v in values]
    return {"t": bins.centres(), "p50": p50, "p95": p95, "count": [len(v) for v in values]}


def run_window(history: list[dict[str, str]]) -> tuple[float, float] | None:
    """(first, last) timestamp of Locust's stats history, in whole seconds; None without a history."""
    stamps = [int(row["Timestamp"]) for row in history]
    return (min(stamps), max(stamps)) if stamps else None


def users_over_time(history: list[dict[str, str]], t0: float) -> tuple[list[float], list[int]]:
    """Locust's user count per history timestamp (one value per second, whatever the number of entries and types)."""
    users: dict[int, int] = {}
    for row in history:
        users.setdefault(int(row["Timestamp"]), int(row["User Count"]))
    times = sorted(users)
    return [t - t0 for t in times], [users[t] for t in times]


def percentile_bars(summary: dict, metric: str, percentiles: tuple[int, ...]) -> tuple[list[str], list[float], int]:
    """(labels, values with NaN for none, number of samples behind them) for one panel of the percentile chart."""
    dist = summary.get(metric) or {}
    labels = [f"p{p}" for p in percentiles]
    values = [math.nan if dist.get(label) is None else float(dist[label]) for label in labels]
    return labels, values, int(dist.get("count") or 0)
