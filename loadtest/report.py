"""Summarise a Locust run: exact percentiles from the samples file (Locust's CSV as a fallback), SLO checks."""
from __future__ import annotations

import csv
import json
from collections import Counter
from pathlib import Path

import numpy as np

PERCENTILES = (50, 90, 95, 99)
METRICS = ("ttft_ms", "itl_ms", "e2e_ms")
_CSV_NAMES = {"ttft_ms": "ttft", "itl_ms": "itl", "e2e_ms": "e2e"}


def read_csv(path: Path) -> list[dict[str, str]]:
    if not path.exists():
        return []
    with path.open(newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def read_samples(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def distribution(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    arr = np.asarray(values, dtype=float)
    out = {f"p{p}": float(np.percentile(arr, p)) for p in PERCENTILES}
    return {**out, "mean": float(arr.mean()), "min": float(arr.min()), "max": float(arr.max()), "count": len(arr)}


def from_samples(samples: list[dict]) -> dict:
    """Throughput over the window from the first request's start to the last request's end."""
    begin = min(s["start"] for s in samples)
    end = max(s["start"] + s["e2e_ms"] / 1000.0 for s in samples)
    window = max(end - begin, 1e-9)
    tokens = sum(s["output_tokens"] for s in samples)
    return {
        "requests": len(samples),
        "window_s": window,
        "requests_per_s": len(samples) / window,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / window,
        "output_tokens_mean": tokens / len(samples),
        **{m: distribution([s[m] for s in samples if s.get(m) is not None]) for m in METRICS},
    }


def from_locust_csv(stats: list[dict[str, str]]) -> dict:
    """Fallback when no samples exist: Locust's own (rounded) percentiles."""
    rows = {row["Name"]: row for row in stats}
    e2e = rows.get("e2e")
    if e2e is None or int(e2e["Request Count"]) - int(e2e["Failure Count"]) == 0:
        return {"requests": 0}
    ok = int(e2e["Request Count"]) - int(e2e["Failure Count"])
    rps = float(e2e["Requests/s"]) * ok / max(int(e2e["Request Count"]), 1)
    tokens_mean = float(e2e["Average Content Size"])
    out = {"requests": ok, "requests_per_s": rps, "output_tokens_mean": tokens_mean,
           "output_tokens_per_s": rps * tokens_mean}
    for metric, name in _CSV_NAMES.items():
        row = rows.get(name)
        out[metric] = None if row is None else {
            **{f"p{p}": to_float(row.get(f"{p}%")) for p in PERCENTILES},
            "mean": to_float(row["Average Response Time"]),
            "count": int(row["Request Count"]) - int(row["Failure Count"])}
    return out


def to_float(text: str | None) -> float | None:
    try:
        return float(text)
    except (TypeError, ValueError):
        return None  # Locust writes "N/A" for empty entries


def failures(stats: list[dict[str, str]], failure_rows: list[dict[str, str]], failed: list[dict]) -> dict:
    """Samples first: Locust's final CSV is written on a timer and can miss the last second."""
    if failed:
        return {"count": len(failed), "messages": dict(Counter(s["error"] for s in failed))}
    count = sum(int(row["Failure Count"]) for row in stats if row["Name"] != "Aggregated")
    return {"count": count, "messages": {row["Error"]: int(row["Occurrences"]) for row in failure_rows}}


def check_slos(summary: dict, slo_ttft_p95_ms: float | None, slo_itl_p95_ms: float | None) -> dict:
    """Each SLO: target, measured p95 and pass/fail; a missing measurement fails the SLO."""
    slos = {}
    for name, target in (("ttft_p95_ms", slo_ttft_p95_ms), ("itl_p95_ms", slo_itl_p95_ms)):
        if target is None:
            continue
        dist = summary.get(name.replace("_p95", ""))
        measured = dist.get("p95") if dist else None
        slos[name] = {"target": target, "measured": measured, "passed": measured is not None and measured <= target}
    return slos


def decoding(settings: dict, ok: list[dict]) -> dict:
    """How the run asked the model to decode (prompt format, ignore_eos) and what it did: finish reasons, how many
    requests gave an inter-token latency (two or more tokens) and how many ended after one token or none."""
    return {
        "prompt_format": settings.get("prompt_format", "raw"),
        "ignore_eos": bool(settings.get("ignore_eos")),
        "finish_reasons": dict(Counter(str(s.get("finish_reason")) for s in ok)),
        "requests_with_itl": sum(1 for s in ok if s.get("itl_ms") is not None),
        "one_token_or_less": sum(1 for s in ok if (s.get("output_tokens") or 0) <= 1),
    }


def in_flight_at_stop(stopped: list[dict]) -> dict:
    """Requests the end of the run cut off: their tokens count in the throughput chart, not in the figures."""
    return {"requests": len(stopped), "output_tokens": sum(s.get("output_tokens") or 0 for s in stopped)}


def summarize(prefix: Path, samples_path: Path, settings: dict, slo_ttft=None, slo_itl=None) -> dict:
    stats = read_csv(Path(f"{prefix}_stats.csv"))
    samples = read_samples(samples_path)
    ok = [s for s in samples if "error" not in s and not s.get("stopped")]
    summary = {"settings": settings, "source": "samples" if ok else "locust_csv"}
    summary.update(from_samples(ok) if ok else from_locust_csv(stats))
    summary["decoding"] = decoding(settings, ok)
    summary["in_flight_at_stop"] = in_flight_at_stop([s for s in samples if s.get("stopped")])
    failed = [s for s in samples if "error" in s]
    summary["failures"] = failures(stats, read_csv(Path(f"{prefix}_failures.csv")), failed)
    summary["slo"] = check_slos(summary, slo_ttft, slo_itl)
    summary["passed"] = (summary["failures"]["count"] == 0 and summary["requests"] > 0
                         and all(s["passed"] for s in summary["slo"].values()))
    return summary


def table(summary: dict) -> str:
    """A plain-text table for the terminal."""
    lines = [
        f"requests {summary['requests']}   failures {summary['failures']['count']}   "
        f"req/s {summary.get('requests_per_s', 0):.2f}   output tok/s {summary.get('output_tokens_per_s', 0):.1f}   "
        f"mean output tokens {summary.get('output_tokens_mean', 0):.1f}",
        f"{'metric':<10}" + "".join(f"{'p' + str(p):>10}" for p in PERCENTILES) + f"{'mean':>10}",
    ]
    for metric in METRICS:
        dist = summary.get(metric)
        cells = [dist.get(f"p{p}") for p in PERCENTILES] + [dist.get("mean")] if dist else [None] * 5
        lines.append(f"{metric:<10}" + "".join(f"{c:>10.1f}" if c is not None else f"{'-':>10}" for c in cells))
    lines.append(decoding_line(summary))
    for name, slo in summary["slo"].items():
        got = "-" if slo["measured"] is None else f"{slo['measured']:.1f}"
        lines.append(f"SLO {name} <= {slo['target']}: measured {got} -> {'pass' if slo['passed'] else 'MISSED'}")
    for message, count in summary["failures"]["messages"].items():
        lines.append(f"failure x{count}: {message}")
    return "\n".join(lines)


def decoding_line(summary: dict) -> str:
    """One line saying how the prompts were sent and whether the requests really decoded."""
    d, cut = summary.get("decoding") or {}, summary.get("in_flight_at_stop") or {}
    finish = ", ".join(f"{k} {v}" for k, v in sorted((d.get("finish_reasons") or {}).items())) or "-"
    line = (f"decoding: prompts {d.get('prompt_format', '?')}, ignore_eos {'on' if d.get('ignore_eos') else 'off'}; "
            f"finish {finish}; ITL from {d.get('requests_with_itl', 0)} of {summary['requests']} requests, "
            f"{d.get('one_token_or_less', 0)} ended after one token or none")
    if cut.get("requests"):
        line += f"; cut off at the stop: {cut['requests']} requests, {cut['output_tokens']} tokens (chart only)"
    return line
