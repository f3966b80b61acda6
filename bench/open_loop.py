"""Open-loop arrivals for the served benchmark: requests sent at Poisson times whatever the server's pace, and the
figures serving benchmarks report for them.

Per request: time to first token (TTFT), time per output token after the first (TPOT = (end - first) / (tokens -
1)), the gaps between streamed responses (ITL; a response that carries k tokens counts as k gaps of gap / k) and the
end-to-end latency. Per rate: completed requests/s, output tokens/s, mean / p50 / p99 of each latency, and goodput:
the requests/s that met the SLO (TTFT and TPOT both within their limits).

Output tokens/s over the whole run counts the first requests' ramp-up and the last ones' generations after the last
arrival, so a short run reads low even when the server kept up. `mid_output_tok_per_s` counts only the tokens that
arrived in the middle half of the arrival span (from 25% to 75% of the time between the first and the last send),
and `mid_vs_arrivals` divides it by the rate the arrivals ask for (all their output tokens over the arrival span):
about 1 when the server keeps up, less when a queue builds.
"""
from __future__ import annotations

import asyncio
import random
import statistics
import time
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Slo:
    """A request is good when its TTFT and TPOT are both within these limits."""

    ttft_s: float = 1.0
    tpot_s: float = 0.05


@dataclass
class RequestTiming:
    """What one streamed request saw, in seconds from its own send."""

    ttft: float | None = None
    end: float = 0.0
    tokens: int = 0
    gaps: list[float] = field(default_factory=list)  # per output token after the first
    sent_at: float | None = None  # time.perf_counter() at the send
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (time.perf_counter(), tokens) of each response

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.tokens < 2:
            return None
        return (self.end - self.ttft) / (self.tokens - 1)


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    """n send times (seconds from the start) with exponential gaps of mean 1 / rate; the first at 0."""
    if n < 1 or rate <= 0:
        raise ValueError(f"need n >= 1 and rate > 0, got n={n}, rate={rate}")
    rng = random.Random(seed)
    times, t = [0.0], 0.0
    for _ in range(n - 1):
        t += rng.expovariate(rate)
        times.append(t)
    return times


async def timed_stream(stream) -> RequestTiming:
    """Consume an async iterator of chunks (each with .tokens()), timing the first token and every later gap."""
    start = last = time.perf_counter()
    timing = RequestTiming(sent_at=start)
    async for chunk in stream:
        n = chunk.tokens()
        if not n:
            continue
        now = time.perf_counter()
        if timing.ttft is None:
            timing.ttft = now - start
            n_gaps, gap = n - 1, 0.0
        else:
            n_gaps, gap = n, (now - last) / n
        timing.gaps.extend([gap] * n_gaps)
        timing.tokens += n
        timing.chunks.append((now, n))
        last = now
    timing.end = time.perf_counter() - start
    return timing


async def run_open_loop(send, requests: list, times: list[float]) -> tuple[list[RequestTiming], float]:
    """Start send(request) (a coroutine returning RequestTiming) at each time; returns the timings and the wall
    seconds from the first send to the last answer."""
    start = time.perf_counter()

    async def at(t: float, request):
        await asyncio.sleep(max(0.0, start + t - time.perf_counter()))
        return await send(request)

    timings = await asyncio.gather(*(at(t, r) for t, r in zip(times, requests)))
    return list(timings), time.perf_counter() - start


def _stats(values: list[float]) -> dict:
    if not values:
        return {}
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3  # noqa: E731
    return {"mean": round(statistics.mean(ordered) * 1e3, 2), "p50": round(pick(0.5), 2),
            "p99": round(pick(0.99), 2)}


def middle_window(timings: list[RequestTiming]) -> dict:
    """Output tok/s over the middle half of the arrival span, and its ratio to the rate the arrivals ask for (their
    output tokens over the span); empty without send times or with a span of zero."""
    sends = [t.sent_at for t in timings if t.sent_at is not None]
    span = max(sends) - min(sends) if sends else 0.0
    if span <= 0:
        return {}
    lo, hi = min(sends) + 0.25 * span, min(sends) + 0.75 * span
    inside = sum(n for t in timings for at, n in t.chunks if lo <= at < hi)
    asked = sum(t.tokens for t in timings) / span
    mid = inside / (hi - lo)
    return dict(mid_output_tok_per_s=round(mid, 1), mid_vs_arrivals=round(mid / asked, 3) if asked else None)


def summarize(timings: list[RequestTiming], wall: float, slo: Slo) -> dict:
    """The serving figures of one rate (latencies in ms)."""
    done = [t for t in timings if t.ttft is not None]
    good = [t for t in done if t.ttft <= slo.ttft_s and (t.tpot is None or t.tpot <= slo.tpot_s)]
    tokens = sum(t.tokens for t in timings)
    return dict(**middle_window(timings), requests=len(timings), completed=len(done), output_tokens=tokens, wall_s=round(wall, 3),
                requests_per_s=round(len(done) / wall, 3), output_tok_per_s=round(tokens / wall, 1),
                ttft_ms=_stats([t.ttft for t in done]), tpot_ms=_stats([t.tpot for t in done if t.tpot is not None]),
                itl_ms=_stats([g for t in done for g in t.gaps]), e2e_ms=_stats([t.end for t in done]),
                goodput_requests_per_s=round(len(good) / wall, 3), good_fraction=round(len(good) / max(len(done), 1), 3))
