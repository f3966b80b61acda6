"""Exponential back-off for a load-test user whose server cannot be reached."""
from __future__ import annotations


class Backoff:
    """Seconds to wait after each failure in a row: first_s, doubling, at most max_s; a success starts over."""

    def __init__(self, first_s: float = 0.5, max_s: float = 5.0):
        if not 0 < first_s <= max_s:
            raise ValueError(f"need 0 < first_s <= max_s, got first_s={first_s}, max_s={max_s}")
        self.first_s, self.max_s = first_s, max_s
        self.failures = 0

    def failed(self) -> float:
        """Count one more failure in a row; the seconds to wait before the next try."""
        delay = min(self.first_s * 2 ** self.failures, self.max_s)
        self.failures += 1
        return delay

    def succeeded(self) -> None:
        self.failures = 0
