"""Python's cyclic garbage collector as the engine sees it: how often it stops every thread, and for how long.

A collection holds the GIL: while it runs, the engine loop cannot launch the next step. A full collection walks
every tracked object of the process, and a served model's process holds millions of them (torch, transformers,
the model's modules), while the output and sender threads create a few objects per token. `freeze_heap` moves
everything alive after start-up to the permanent generation, so collections only walk what was made since;
`thaw_heap` gives it back when the engine stops, or its frozen reference cycles (CUDA tensors among them) would
never be freed.
"""
from __future__ import annotations

import gc
import threading
import time

__all__ = ["GcPauses", "freeze_heap", "thaw_heap"]


def freeze_heap() -> None:
    """Collect once, then exempt every object alive now from later collections (gc.freeze)."""
    gc.collect()
    gc.freeze()


def thaw_heap() -> None:
    """Undo freeze_heap (process-wide): frozen objects are collectable again, e.g. a stopped engine's cycles."""
    gc.unfreeze()


class GcPauses:
    """Counts collections per generation and their total and longest pause, from gc.callbacks."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._start: float | None = None
        self.collections = [0, 0, 0]
        self.seconds = 0.0
        self.longest = 0.0
        gc.callbacks.append(self._on_gc)

    def close(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        # runs in whichever thread triggered the collection, with the GIL held: keep it to a few operations
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            pause = time.perf_counter() - self._start
            self._start = None
            with self._lock:
                self.collections[info["generation"]] += 1
                self.seconds += pause
                self.longest = max(self.longest, pause)

    def snapshot(self) -> dict:
        """gc_collections (per generation), gc_pause_s (total) and gc_longest_pause_ms since start."""
        with self._lock:
            return {"gc_collections": list(self.collections), "gc_pause_s": round(self.seconds, 4),
                    "gc_longest_pause_ms": round(self.longest * 1e3, 3)}
