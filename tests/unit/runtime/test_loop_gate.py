"""The loop gate: helpers pass at once while it is open or disabled, and wait at most max_wait_s while closed."""
from __future__ import annotations

import threading
import time

from backend.runtime.loop_gate import LoopGate


def timed_pass(gate: LoopGate) -> float:
    start = time.perf_counter()
    gate.yield_to_loop()
    return time.perf_counter() - start


def test_open_and_disabled_gates_let_helpers_through_at_once():
    gate = LoopGate(enabled=True, max_wait_s=1.0)
    assert timed_pass(gate) < 0.1  # open when made
    gate.close()
    gate.open()
    assert timed_pass(gate) < 0.1
    gate.close()
    gate.disable()
    assert timed_pass(gate) < 0.1
    off = LoopGate(enabled=False, max_wait_s=1.0)
    off.close()  # a gate made disabled (no CUDA) never closes
    assert timed_pass(off) < 0.1


def test_closed_gate_holds_a_helper_until_the_loop_blocks_or_the_limit():
    gate = LoopGate(enabled=True, max_wait_s=0.3)
    gate.close()
    assert 0.25 < timed_pass(gate) < 2.0  # nobody opened it: the limit lets the helper on
    threading.Timer(0.05, gate.open).start()
    held = timed_pass(gate)
    assert 0.03 < held < 0.25  # released when the loop opened it, before the limit
