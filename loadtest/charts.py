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


def throughput_over_time(history: list[dict[str, str]], path: Path) -> None:
    """Requests/s and output tokens/s from the e2e entry's cumulative count × mean tokens, with users."""
    rows = _series(history, "e2e")
    if len(rows) < 2:
        return
    t0 = _start(history)
    times = [int(r["Timestamp"]) - t0 for r in rows]
    counts = [float(r["Total Request Count"]) - float(r["Total Failure Count"]) for r in rows]
    tokens = [int(r["Total Request Count"]) * float(r["Total Average Content Size"]) for r in rows]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    ax1.plot(times, _rates(times, counts), label="completed requests/s")
    ax1.set_ylabel("requests/s")
    users = ax1.twinx()
    users.plot(times, [int(r["User Count"]) for r in rows], color="grey", linestyle="--", label="users")
    users.set_ylabel("users")
    users.set_ylim(bottom=0)
    ax2.plot(times, _rates(times, tokens), color="tab:green")
    ax2.set_ylabel("output tokens/s")
    ax2.set_xlabel("seconds since start")
    ax1.set_title("Throughput over time (per-second completions)")
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


def write_all(history: list[dict[str, str]], summary: dict, out: Path) -> list[Path]:
    paths = [out / "throughput.png", out / "latency_over_time.png", out / "latency_percentiles.png"]
    throughput_over_time(history, paths[0])
    latency_over_time(history, paths[1])
    latency_percentiles(summary, paths[2])
    return [p for p in paths if p.exists()]
