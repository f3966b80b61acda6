"""The shutdown drain (model_repository/llm/1/drain.py) with a stand-in response loop: it is over at once when no
request is in flight, waits for running ones, stops the rest at its deadline, and reports a model Triton keeps
loaded after it (engine stopped, then the held marker) unless finalize begins first."""
from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "model_repository" / "llm" / "1"))
from drain import HELD_MARKER, Drain, held_marker  # noqa: E402

from scripts import server_stop  # noqa: E402


class _Loop:
    """In-flight requests that end after given delays (or when aborted), and the engine stop's calls."""

    def __init__(self, *lifetimes: float, stop_engine_result: bool = True) -> None:
        now = time.monotonic()
        self.ends = [now + t for t in lifetimes]
        self.aborts: list[str] = []
        self.stops = 0
        self.stop_engine_result = stop_engine_result
        self.logs: list[str] = []
        self._lock = threading.Lock()

    def in_flight(self) -> int:
        with self._lock:
            return sum(end > time.monotonic() for end in self.ends)

    def abort_all(self, message: str) -> int:
        with self._lock:
            self.aborts.append(message)
            left = sum(end > time.monotonic() for end in self.ends)
            self.ends = [min(end, time.monotonic() + 0.1) for end in self.ends]  # answered on the next step
            return left

    def stop_engine(self) -> bool:
        self.stops += 1
        return self.stop_engine_result


def _drain(loop: _Loop, tmp_path: Path, timeout_s: float = 5.0, finalize_wait_s: float = 0.3) -> tuple[Drain, Path]:
    marker = Path(held_marker(str(tmp_path / "drain"), os.getpid()))
    drain = Drain(loop.in_flight, loop.abort_all, loop.stop_engine, timeout_s, str(marker), loop.logs.append,
                  finalize_wait_s=finalize_wait_s)
    drain.start()
    return drain, marker


def test_nothing_in_flight_ends_the_drain_at_once_and_finalize_skips_the_report(tmp_path):
    loop = _Loop()
    started = time.monotonic()
    drain, marker = _drain(loop, tmp_path)
    assert drain.wait_over(1.0)
    assert time.monotonic() - started < 0.3
    drain.finalizing()  # Triton finalizes the model: not held
    drain.join(2)
    assert loop.aborts == [] and loop.stops == 0 and not marker.exists()
    assert loop.logs[0].startswith("tandem: drain over after 0.") and loop.logs[0].endswith("no request in flight")


def test_running_requests_finish_before_the_drain_is_over(tmp_path):
    loop = _Loop(0.3, 0.5)
    started = time.monotonic()
    drain, _ = _drain(loop, tmp_path)
    assert not drain.wait_over(0.2)
    assert drain.wait_over(2.0)
    assert 0.5 <= time.monotonic() - started < 0.8
    drain.finalizing()
    drain.join(2)
    assert loop.aborts == [] and loop.stops == 0


def test_requests_running_at_the_deadline_are_stopped_with_the_shutdown_message(tmp_path):
    loop = _Loop(60.0, 60.0)
    drain, _ = _drain(loop, tmp_path, timeout_s=0.3)
    assert drain.wait_over(2.0)
    drain.finalizing()
    drain.join(2)
    assert loop.aborts == ["the server is shutting down: the request was stopped (finish_reason abort) after the "
                           "0.3 s drain; retry on another replica"]
    assert loop.logs[0] == "tandem: drain time over: 2 request(s) stopped"
    assert loop.logs[1].endswith("no request in flight")


def test_a_model_triton_keeps_loaded_stops_its_engine_and_writes_the_held_marker(tmp_path):
    loop = _Loop()
    drain, marker = _drain(loop, tmp_path, finalize_wait_s=0.2)
    drain.join(3)
    assert loop.stops == 1
    assert marker.read_text() == f"{os.getpid()}\n"
    assert server_stop.held_markers(tmp_path / "drain") == {os.getpid()}
    assert "Triton still keeps the model loaded 0.2 s after the drain" in loop.logs[-1]


def test_no_marker_when_finalize_stopped_the_engine_first(tmp_path):
    loop = _Loop(stop_engine_result=False)
    drain, marker = _drain(loop, tmp_path, finalize_wait_s=0.1)
    drain.join(3)
    assert loop.stops == 1 and not marker.exists()


def test_the_launcher_reads_the_marker_the_drain_writes():
    assert server_stop.HELD_MARKER == HELD_MARKER
