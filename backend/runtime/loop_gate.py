"""The GIL between the engine loop and its helper threads: helpers do their Python while the loop waits."""
from __future__ import annotations

import threading


class LoopGate:
    """Open while the engine loop is blocked (on the GPU, or waiting for work); helper threads pass it between
    pieces of work.

    Python hands the GIL to a waiting thread after each switch interval and gets it back only when that thread
    blocks or its own interval ends. A helper thread busy with outputs therefore makes each GIL-releasing CUDA
    call of the loop wait, for up to a switch interval each time: on the H200 host a decode step's launch took
    330-420 us, against about 100 us for its calls one by one (bench/launch_cost.py). Helpers that pass the
    gate run while the loop is blocked anyway. A pass waits at most max_wait_s, so a loop that never blocks
    cannot starve them. Without CUDA the loop's model runs inside launch, so the gate stays open there.
    """

    def __init__(self, enabled: bool, max_wait_s: float = 0.002) -> None:
        self.enabled = enabled
        self.max_wait_s = max_wait_s
        self._open = threading.Event()
        self._open.set()

    def open(self) -> None:
        """The loop is about to block: helpers may run."""
        self._open.set()

    def close(self) -> None:
        """The loop works on the CPU: helpers wait at their next pass (briefly)."""
        if self.enabled:
            self._open.clear()

    def disable(self) -> None:
        """The loop has stopped: the gate stays open."""
        self.enabled = False
        self._open.set()

    def yield_to_loop(self) -> None:
        """A helper's pause point between pieces of work."""
        if self.enabled and not self._open.is_set():
            self._open.wait(self.max_wait_s)
