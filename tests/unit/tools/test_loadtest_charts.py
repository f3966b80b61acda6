"""The numbers behind the load-test charts (rates, gaps, counts, tokens cut off at the stop) and the summary's
statement of how the run decoded; data, not pixels."""
from __future__ import annotations

import math

import pytest

from loadtest.chart_data import (
    Bins, bin_seconds, generated_per_second, latency_per_bin, percentile_bars, requests_per_second, run_window,
    users_over_time,
)
from loadtest.report import PERCENTILES, decoding_line, distribution, summarize


def ok(start: float, e2e_ms: float, tokens: int = 10, ttft_ms: float = 100.0, itl_ms: float | None = 5.0) -> dict:
    return {"start": start, "ttft_ms": ttft_ms, "itl_ms": itl_ms, "e2e_ms": e2e_ms, "output_tokens": tokens,
            "finish_reason": "length"}


def test_bins_follow_the_run_and_hold_several_requests_each():
    assert bin_seconds(60) == 1 and bin_seconds(600) == 10 and bin_seconds(10_000) == 300
    assert bin_seconds(600, events=216) == 15  # the soak's 0.36 requests/s: 5 or more per bin
    bins = Bins([ok(100.0, 1000.0), ok(100.0, 8600.0)], bin_s=2.0)
    assert bins.edges == pytest.approx([0.0, 2.0, 4.0, 6.0, 8.6])  # a last 0.6 s < half a bin joins the one before
    assert bins.widths == pytest.approx([2.0, 2.0, 2.0, 2.6])
    assert bins.index(100.0 + 8.6) == 3 and bins.index(99.0) is None
    assert Bins([ok(100.0, 1000.0), ok(100.0, 9200.0)], bin_s=2.0).widths == pytest.approx([2.0] * 4 + [1.2])
    wide = Bins([ok(100.0, 1000.0)], bin_s=1.0, run=(99.0, 105.0))  # Locust's own start and end widen the span
    assert wide.t0 == 99.0 and wide.edges[-1] == 6.0


def test_requests_per_second_is_a_rate_not_a_running_total():
    # 0.5 requests/s for 100 s: every bin says 0.5, none climbs as a running total would
    samples = [ok(100.0 + 2 * i, 1000.0) for i in range(50)]
    samples += [{"start": 150.5, "error": "boom", "e2e_ms": 0.0}]
    times, done, failed = requests_per_second(samples, Bins(samples, bin_s=10.0, run=(100.0, 200.0)))
    assert times[:2] == [5.0, 15.0]
    assert done == pytest.approx([0.5] * 10) and sum(failed) == pytest.approx(0.1)
    assert failed[5] == pytest.approx(0.1)  # the failure at 50.5 s, counted in its bin


def test_latency_per_bin_leaves_gaps_and_counts_samples():
    samples = [ok(100.0, 500.0, ttft_ms=50.0), ok(100.2, 700.0, ttft_ms=70.0), ok(108.0, 900.0, ttft_ms=90.0),
               ok(100.0, 3000.0, itl_ms=None) | {"stopped": True, "stopped_ms": 3000.0}]  # cut off: no latency
    data = latency_per_bin(samples, Bins(samples, bin_s=1.0), "e2e_ms")
    assert data["count"] == [2, 0, 0, 0, 0, 0, 0, 0, 1]
    assert data["p50"][0] == pytest.approx(600.0) and data["p95"][0] == pytest.approx(690.0)
    assert all(math.isnan(v) for v in data["p50"][1:8])  # no requests there: a gap, never 0 ms
    assert data["p50"][8] == 900.0
    ttft = latency_per_bin(samples, Bins(samples, bin_s=1.0), "ttft_ms")
    assert ttft["count"][0] == 2 and ttft["count"][8] == 1  # TTFT sits where the first token came


def test_generated_tokens_are_spread_and_those_cut_off_at_the_stop_count():
    samples = [
        # first token at 1.0 s, end at 3.0 s: 100 tokens → 50 tok/s over bins 1 and 2
        {"start": 100.5, "ttft_ms": 500.0, "e2e_ms": 2500.0, "output_tokens": 100},
        # cut off by the stop at 4.0 s: 10 tokens between 2.5 s and 3.5 s, half in bin 2, half in bin 3
        {"start": 102.0, "ttft_ms": 500.0, "e2e_ms": 1500.0, "output_tokens": 10, "stopped": True,
         "stopped_ms": 2000.0},
        {"start": 100.0, "error": "boom", "e2e_ms": 5.0},  # failures carry no tokens
    ]
    times, rates = generated_per_second(samples, Bins(samples, bin_s=1.0))
    assert times == [0.5, 1.5, 2.5, 3.5]
    assert rates == pytest.approx([0.0, 50.0, 55.0, 5.0])
    assert sum(rates) == pytest.approx(110.0)  # every token counted once, the cut-off ones included


def test_users_over_time_takes_one_value_per_second_whatever_the_entries():
    rows = [{"Timestamp": "10", "User Count": "0", "Type": "grpc", "Name": "e2e"},
            {"Timestamp": "11", "User Count": "4", "Type": "grpc", "Name": "e2e"},
            {"Timestamp": "11", "User Count": "4", "Type": "http", "Name": "e2e"},
            {"Timestamp": "12", "User Count": "4", "Type": "", "Name": "Aggregated"}]
    assert users_over_time(rows, t0=10.0) == ([0.0, 1.0, 2.0], [0, 4, 4])
    assert run_window(rows) == (10, 12) and run_window([]) is None


def test_percentile_bars_carry_their_sample_count_and_no_fake_zeros():
    summary = {"ttft_ms": distribution([10.0, 20.0, 30.0]), "itl_ms": None}
    labels, values, count = percentile_bars(summary, "ttft_ms", PERCENTILES)
    assert labels == ["p50", "p90", "p95", "p99"] and count == 3 and values[0] == 20.0
    _, values, count = percentile_bars(summary, "itl_ms", PERCENTILES)
    assert count == 0 and all(math.isnan(v) for v in values)


def test_summary_states_how_the_run_decoded(tmp_path):
    import json

    samples = [ok(100.0, 1000.0), ok(101.0, 200.0, tokens=1, itl_ms=None) | {"finish_reason": "stop"},
               ok(102.0, 800.0) | {"stopped": True, "stopped_ms": 900.0, "output_tokens": 7}]
    path = tmp_path / "samples.jsonl"
    path.write_text("".join(json.dumps(s) + "\n" for s in samples))
    summary = summarize(tmp_path / "locust", path, {"prompt_format": "chat template (chatml)", "ignore_eos": False})
    assert summary["requests"] == 2  # the cut-off request is not a completed one
    assert summary["decoding"] == {"prompt_format": "chat template (chatml)", "ignore_eos": False,
                                   "finish_reasons": {"length": 1, "stop": 1}, "requests_with_itl": 1,
                                   "one_token_or_less": 1}
    assert summary["in_flight_at_stop"] == {"requests": 1, "output_tokens": 7}
    assert summary["ttft_ms"]["count"] == 2 and summary["itl_ms"]["count"] == 1
    line = decoding_line(summary)
    assert line.startswith("decoding: prompts chat template (chatml), ignore_eos off; finish length 1, stop 1")
    assert "ITL from 1 of 2 requests, 1 ended after one token or none" in line
    assert "cut off at the stop: 1 requests, 7 tokens" in line
