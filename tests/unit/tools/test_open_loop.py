"""Open-loop arrivals (bench/open_loop.py): Poisson send times, per-request timing of a stream, the summary's figures."""
from __future__ import annotations

import asyncio
import math

import pytest

from bench.open_loop import (RequestTiming, Slo, middle_window, poisson_arrivals, run_open_loop, summarize,
                             timed_stream)


def test_poisson_arrivals_have_exponential_gaps_of_the_asked_mean():
    times = poisson_arrivals(20000, rate=4.0, seed=3)
    assert len(times) == 20000 and times[0] == 0.0
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert all(g >= 0 for g in gaps)
    mean = sum(gaps) / len(gaps)
    assert abs(mean - 0.25) < 0.25 * 4 / math.sqrt(len(gaps))  # 4 standard errors of an Exp(4) mean
    # Kolmogorov-Smirnov distance to the Exp(4) CDF, below its 0.1% critical value 1.95 / sqrt(n)
    ordered = sorted(gaps)
    n = len(ordered)
    distance = max(max((i + 1) / n - (1 - math.exp(-4 * g)), (1 - math.exp(-4 * g)) - i / n)
                   for i, g in enumerate(ordered))
    assert distance < 1.95 / math.sqrt(n)
    assert poisson_arrivals(5, 2.0, seed=1) == poisson_arrivals(5, 2.0, seed=1)
    with pytest.raises(ValueError):
        poisson_arrivals(3, 0.0)


class _Chunk:
    def __init__(self, n):
        self.n = n

    def tokens(self):
        return self.n


async def _paced(sizes, pause):
    for n in sizes:
        await asyncio.sleep(pause)
        yield _Chunk(n)


def test_a_stream_is_timed_token_by_token():
    timing = asyncio.run(timed_stream(_paced([1, 0, 2, 1], 0.02)))
    assert timing.tokens == 4
    assert 0.015 < timing.ttft < 0.2
    # a response of two tokens counts as two gaps; the empty one counts as none
    assert len(timing.gaps) == 3 and timing.gaps[0] == timing.gaps[1]
    assert timing.tpot == pytest.approx((timing.end - timing.ttft) / 3)


def test_requests_start_at_their_times_whatever_the_answers_take():
    starts = []

    async def send(request):
        starts.append(asyncio.get_running_loop().time())
        await asyncio.sleep(0.2)  # slower than the gaps between sends: an open loop does not wait for it
        return RequestTiming(ttft=0.01, end=0.2, tokens=3)

    timings, wall = asyncio.run(run_open_loop(send, ["a", "b", "c"], [0.0, 0.05, 0.1]))
    assert len(timings) == 3
    assert 0.035 < starts[1] - starts[0] < 0.15 and 0.035 < starts[2] - starts[1] < 0.15
    assert 0.29 < wall < 0.6


def test_summary_counts_goodput_against_the_slo():
    timings = [RequestTiming(ttft=0.5, end=1.5, tokens=11, gaps=[0.1] * 10),  # TPOT 100 ms: too slow
               RequestTiming(ttft=0.2, end=0.6, tokens=9, gaps=[0.05] * 8),  # TPOT 50 ms: good
               RequestTiming(ttft=2.0, end=2.1, tokens=2, gaps=[0.1]),  # TTFT 2 s: too slow
               RequestTiming(ttft=0.1, end=0.1, tokens=1),  # one token: judged by TTFT alone, good
               RequestTiming()]  # never answered
    out = summarize(timings, wall=10.0, slo=Slo(ttft_s=1.0, tpot_s=0.05))
    assert out["requests"] == 5 and out["completed"] == 4 and out["output_tokens"] == 23
    assert out["output_tok_per_s"] == 2.3 and out["requests_per_s"] == 0.4
    assert out["goodput_requests_per_s"] == 0.2 and out["good_fraction"] == 0.5
    assert out["ttft_ms"]["p50"] == 500.0 and out["ttft_ms"]["p99"] == 2000.0
    assert out["tpot_ms"]["mean"] == pytest.approx(83.33, abs=0.01)
    assert out["itl_ms"]["p50"] == 100.0


def test_middle_window_counts_the_tokens_of_the_arrival_spans_middle_half():
    """Sends at 0, 4 and 8 s: the window is [2, 6). Two tokens a second are asked for (16 over 8 s); 6 tokens
    arrive inside the window (the chunks at 2, 3 and 5 s), 1.5 a second over its 4 s: 0.75 of the asked rate."""
    timings = [RequestTiming(ttft=1.0, end=3.0, tokens=6, sent_at=0.0, chunks=[(1.0, 1), (2.0, 2), (3.0, 3)]),
               RequestTiming(ttft=1.0, end=2.0, tokens=5, sent_at=4.0, chunks=[(5.0, 1), (6.0, 4)]),  # 6 s: outside
               RequestTiming(ttft=1.0, end=1.0, tokens=5, sent_at=8.0, chunks=[(9.0, 5)])]
    assert middle_window(timings) == dict(mid_output_tok_per_s=1.5, mid_vs_arrivals=0.75)
    assert summarize(timings, wall=10.0, slo=Slo())["mid_vs_arrivals"] == 0.75
    assert middle_window([RequestTiming(tokens=1, sent_at=3.0)]) == {}  # one send: no span
