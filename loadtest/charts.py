"""PNG charts of a load test: throughput and latency over time, latency percentiles (numbers from chart_data)."""
from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no display on servers and CI
import matplotlib.pyplot as plt  # noqa: E402

from loadtest.chart_data import (  # noqa: E402
    Bins, generated_per_second, latency_per_bin, percentile_bars, requests_per_second, run_window,
    users_over_time,
)
from loadtest.report import METRICS, PERCENTILES  # noqa: E402

FEW_SAMPLES = 20  # below this a p95 or p99 is close to the maximum: the chart says so


def headroom(values) -> float:
    """A y limit a quarter above the highest value, so the top line clears the frame and the legend."""
    top = max((v for v in values if not math.isnan(v)), default=0.0)
    return top * 1.25 if top > 0 else 1.0


def throughput_over_time(samples: list[dict], history: list[dict[str, str]], path: Path) -> None:
    """Requests/s completed (and failed) per bin with Locust's users, and output tokens/s as generated."""
    run = run_window(history)
    bins, fine = Bins(samples, run=run), Bins(samples, per_request=False, run=run)  # tokens are spread: finer bins
    times, done, failed = requests_per_second(samples, bins)
    tok_times, tokens = generated_per_second(samples, fine)
    stopped = sum(1 for s in samples if s.get("stopped"))
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    ax1.plot(times, done, marker=".", label="completed")
    if any(failed):
        ax1.plot(times, failed, marker=".", color="tab:red", label="failed")
    ax1.set_ylabel("requests/s")
    ax1.set_ylim(0, headroom(done + failed))
    user_t, user_n = users_over_time(history, bins.t0)
    if user_t:
        users = ax1.twinx()
        users.step(user_t, user_n, where="post", color="grey", linestyle="--", label="users")
        users.set_ylabel("users (dashed)")
        users.set_ylim(0, headroom(user_n))
    ax1.legend(loc="upper left", fontsize=8)
    ax2.plot(tok_times, tokens, marker=".", color="tab:green")
    ax2.set_ylabel("output tokens/s")
    ax2.set_ylim(0, headroom(tokens))
    if not any(tokens):
        ax2.text(0.5, 0.5, "no tokens generated", ha="center", va="center", transform=ax2.transAxes)
    ax2.set_xlim(0, max(bins.edges[-1], fine.edges[-1]))
    ax2.set_xlabel("seconds since the start")
    note = f"; tokens of the {stopped} requests cut off at the stop included" if stopped else ""
    ax2.set_title(f"tokens/s in {fine.bin_s:g} s bins, each request's spread from its first token to its last{note}",
                  fontsize=9)
    ax1.set_title(f"Throughput over time (requests/s: completions in each {bins.bin_s:g} s bin ÷ its length)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def latency_over_time(samples: list[dict], history: list[dict[str, str]], path: Path) -> None:
    """p50 and p95 of the requests measured in each bin, one panel per metric; a bin without any is a gap."""
    bins = Bins(samples, run=run_window(history))
    fig, axes = plt.subplots(len(METRICS), 1, figsize=(9, 8), sharex=True)
    for ax, metric in zip(axes, METRICS):
        data = latency_per_bin(samples, bins, metric)
        for key in ("p50", "p95"):
            ax.plot(data["t"], data[key], marker=".", label=key)  # markers: a bin between two gaps still shows
        n, filled = sum(data["count"]), sum(1 for c in data["count"] if c)
        ax.set_ylabel(f"{metric.removesuffix('_ms')} (ms)")
        ax.set_ylim(bottom=0)
        ax.text(0.01, 0.95, f"{n} requests in {filled} of {len(bins)} bins", transform=ax.transAxes,
                fontsize=8, va="top")
        if n:
            ax.legend(loc="upper right", fontsize=8)
    axes[0].set_title(f"Latency over time (requests measured in each {bins.bin_s:g} s bin; gaps: none measured)")
    axes[-1].set_xlabel("seconds since the start")
    axes[-1].set_xlim(0, bins.edges[-1])
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def latency_percentiles(summary: dict, path: Path) -> None:
    """Bars of p50/p90/p95/p99 for TTFT, ITL and e2e, one panel each, with the number of samples behind them."""
    fig, axes = plt.subplots(1, len(METRICS), figsize=(12, 4))
    for ax, metric in zip(axes, METRICS):
        labels, values, count = percentile_bars(summary, metric, PERCENTILES)
        name = metric.removesuffix("_ms")
        ax.set_ylabel("ms")
        if all(math.isnan(v) for v in values):
            ax.set_title(f"{name} (no samples)")
            ax.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax.transAxes)
            ax.set_xticks([])
            ax.set_yticks([])
            continue
        bars = ax.bar(labels, [0.0 if math.isnan(v) else v for v in values], color="tab:blue")
        ax.bar_label(bars, labels=["-" if math.isnan(v) else f"{v:.1f}" for v in values], fontsize=8)
        few = " — few: high percentiles ≈ max" if 0 < count < FEW_SAMPLES else ""
        ax.set_title(f"{name} (n = {count}{few})", fontsize=10)
    fig.suptitle(f"Latency percentiles ({summary['requests']} requests, source: {summary['source']})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_all(history: list[dict[str, str]], summary: dict, out: Path, samples: list[dict] | None = None
              ) -> list[Path]:
    """The charts there is data for: the over-time ones need the samples file, the percentiles only the summary."""
    paths = []
    if samples:
        throughput_over_time(samples, history, out / "throughput.png")
        latency_over_time(samples, history, out / "latency_over_time.png")
        paths += [out / "throughput.png", out / "latency_over_time.png"]
    latency_percentiles(summary, out / "latency_percentiles.png")
    return paths + [out / "latency_percentiles.png"]
