"""PNG charts of a Locust run: throughput and latency over time (stats history), latency percentiles."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no display on servers and CI
import matplotlib.pyplot as plt  # noqa: E402

from loadtest.report import METRICS, PERCENTILES, to_float  # noqa: E402


def _series(history: list[dict[str, str]], name: str) -> list[dict[str, str]]:
    return [row for row in history if row["Name"] == name]


def _rates(times: list[int], values: list[float]) -> list[float]:
    """Per-interval rate of a cumulative value (Locust's own Requests/s is a slow rolling average)."""
    return [0.0] + [max(b - a, 0.0) / max(tb - ta, 1) for a, b, ta, tb in zip(values, values[1:], times, times[1:])]


def generated_per_second(samples: list[dict], t0: float, bin_s: float = 1.0) -> tuple[list[float], list[float]]:
    """Output tokens/s in bins of bin_s seconds since t0, each request's tokens spread evenly from its first token
    to its end (a whole request's tokens counted at its completion make waves of equal requests look like spikes)."""
    spans = []
    for s in samples:
        if "error" in s or not s.get("output_tokens") or s.get("ttft_ms") is None:
            continue
        first = s["start"] + s["ttft_ms"] / 1000.0 - t0
        end = s["start"] + s["e2e_ms"] / 1000.0 - t0
        spans.append((first, max(end, first + 1e-9), s["output_tokens"]))
    if not spans:
        return [], []
    bins = [0.0] * (int(max(e for _, e, _ in spans) // bin_s) + 1)
    for first, end, tokens in spans:
        rate = tokens / (end - first)
        b = int(first // bin_s)
        while b * bin_s < end:
            overlap = min(end, (b + 1) * bin_s) - max(first, b * bin_s)
            bins[b] += rate * max(overlap, 0.0)
            b += 1
    return [(i + 0.5) * bin_s for i in range(len(bins))], [v / bin_s for v in bins]


def throughput_over_time(history: list[dict[str, str]], path: Path, samples: list[dict] | None = None) -> None:
    """Completed requests/s with users (Locust's history), and output tokens/s as generated (from the samples;
    without them, from completions: the e2e entry's cumulative count × mean tokens)."""
    rows = _series(history, "e2e")
    if len(rows) < 2:
        return
    t0 = _start(history)
    times = [int(r["Timestamp"]) - t0 for r in rows]
    counts = [float(r["Total Request Count"]) - float(r["Total Failure Count"]) for r in rows]
    tok_times, tok_rates = generated_per_second(samples or [], t0)
    token_label = "output tokens/s (as generated)"
    if not tok_times:
        tokens = [int(r["Total Request Count"]) * float(r["Total Average Content Size"]) for r in rows]
        tok_times, tok_rates, token_label = times, _rates(times, tokens), "output tokens/s (at completion)"
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    ax1.plot(times, _rates(times, counts), label="completed requests/s")
    ax1.set_ylabel("requests/s")
    users = ax1.twinx()
    users.plot(times, [int(r["User Count"]) for r in rows], color="grey", linestyle="--", label="users")
    users.set_ylabel("users")
    users.set_ylim(bottom=0)
    ax2.plot(tok_times, tok_rates, color="tab:green")
    ax2.set_ylabel(token_label)
    ax2.set_xlabel("seconds since start")
    ax1.set_title("Throughput over time (requests: per-second completions)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _start(history: list[dict[str, str]]) -> int:
    return min((int(r["Timestamp"]) for r in history), default=0)


def latency_over_time(history: list[dict[str, str]], path: Path) -> None:
    """p50 and p95 of Locust's recent window for each entry, one panel per entry (scales differ)."""
    fig, axes = plt.subplots(len(METRICS), 1, figsize=(9, 8), sharex=True)
    t0 = _start(history)
    for ax, metric in zip(axes, METRICS):
        # rows before the first completion carry placeholder zeros, not measurements
        rows = [r for r in _series(history, metric.removesuffix("_ms")) if int(r["Total Request Count"]) > 0]
        times = [int(r["Timestamp"]) - t0 for r in rows]
        for column in ("50%", "95%"):
            ax.plot(times, [to_float(r[column]) for r in rows], label=f"p{column[:-1]}")
        ax.set_ylabel(f"{metric.removesuffix('_ms')} (ms)")
        ax.legend(loc="upper right")
    axes[0].set_title("Latency over time (Locust's rolling window)")
    axes[-1].set_xlabel("seconds since start")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def latency_percentiles(summary: dict, path: Path) -> None:
    """Bars of p50/p90/p95/p99 for TTFT, ITL and e2e, one panel each."""
    fig, axes = plt.subplots(1, len(METRICS), figsize=(12, 4))
    for ax, metric in zip(axes, METRICS):
        dist = summary.get(metric) or {}
        labels = [f"p{p}" for p in PERCENTILES]
        values = [dist.get(label) or 0.0 for label in labels]
        bars = ax.bar(labels, values, color="tab:blue")
        ax.bar_label(bars, fmt="%.1f", fontsize=8)
        ax.set_title(metric.removesuffix("_ms"))
        ax.set_ylabel("ms")
    fig.suptitle(f"Latency percentiles ({summary['requests']} requests, source: {summary['source']})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_all(history: list[dict[str, str]], summary: dict, out: Path, samples: list[dict] | None = None
              ) -> list[Path]:
    paths = [out / "throughput.png", out / "latency_over_time.png", out / "latency_percentiles.png"]
    throughput_over_time(history, paths[0], samples)
    latency_over_time(history, paths[1])
    latency_percentiles(summary, paths[2])
    return [p for p in paths if p.exists()]
