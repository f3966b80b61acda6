"""What one finished request reports to Locust: named entries for TTFT, ITL and end-to-end latency."""
from __future__ import annotations

from dataclasses import dataclass

from tandem_client.schema import Result

TTFT, ITL, E2E = "ttft", "itl", "e2e"


@dataclass(slots=True)
class Entry:
    """One Locust request event: a name, a time in ms, and a length (output tokens for e2e)."""

    name: str
    response_time_ms: float
    response_length: int = 0


def entries(result: Result) -> list[Entry]:
    """ttft and itl only when measurable (a token arrived; at least two responses carried tokens)."""
    out = []
    if result.ttft_s is not None:
        out.append(Entry(TTFT, result.ttft_s * 1000.0))
    if result.itl_s is not None:
        out.append(Entry(ITL, result.itl_s * 1000.0))
    out.append(Entry(E2E, (result.e2e_s or 0.0) * 1000.0, result.num_output_tokens))
    return out


def sample(result: Result, start_unix: float, protocol: str) -> dict:
    """One line of the raw samples file: exact timings, which Locust rounds (to whole ms below 100 ms)."""
    return {
        "start": start_unix,
        "protocol": protocol,
        "ttft_ms": None if result.ttft_s is None else result.ttft_s * 1000.0,
        "itl_ms": None if result.itl_s is None else result.itl_s * 1000.0,
        "e2e_ms": (result.e2e_s or 0.0) * 1000.0,
        "output_tokens": result.num_output_tokens,
        "input_tokens": result.num_input_tokens,
        "finish_reason": result.finish_reason,
    }


def failure_sample(error: Exception, start_unix: float, protocol: str, elapsed_ms: float) -> dict:
    """One line of the samples file for a failed request (Locust's final CSV can miss the last second)."""
    return {"start": start_unix, "protocol": protocol, "error": str(error), "e2e_ms": elapsed_ms}


def stopped_sample(result: Result, start_unix: float, protocol: str, stopped_ms: float) -> dict:
    """A request the end of the run cut off: its tokens so far (e2e_ms: its last response) count in the throughput
    chart, not in the latency figures; stopped_ms is when the stop came, the end of the run."""
    return sample(result, start_unix, protocol) | {"stopped": True, "stopped_ms": stopped_ms}
