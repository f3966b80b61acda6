"""Python's cyclic garbage collector as the engine sees it: how often it stops every thread, and for how long.

A collection holds the GIL: while it runs, the engine loop cannot launch the next step. A full collection walks
every tracked object of the process, and a served model's process holds millions of them (torch, transformers,
the model's modules), while the output and sender threads create a few objects per token. `freeze_heap` moves
everything alive after start-up to the permanent generation, so collections only walk what was made since;
`thaw_heap` gives it back when the engine stops, or its frozen reference cycles (CUDA tensors among them) would
never be freed.

Python collects its young generation every 700 new tracked objects by default. A served model makes a few per
token (outputs, responses), and at 256 streams many of them are still queued when a collection comes, so they
survive into the older generations, whose collections then walk them again and again: on the CPU machine, the
stand-in model served at 256 streams spent 0.53-0.60 s of a 3 s run in collections (longest 29-44 ms).
`set_young_threshold` collects the young generation less often, after most of those objects have died
(0.03-0.05 s, longest 18-21 ms at 50,000).
"""
from __future__ import annotations

import gc
import threading
import time

__all__ = ["GcPauses", "freeze_heap", "thaw_heap", "set_young_threshold", "restore_thresholds"]


def freeze_heap() -> None:
    """Collect once, then exempt every object alive now from later collections (gc.freeze)."""
    gc.collect()
    gc.freeze()


def thaw_heap() -> None:
    """Undo freeze_heap (process-wide): frozen objects are collectable again, e.g. a stopped engine's cycles."""
    gc.unfreeze()


def set_young_threshold(young: int) -> tuple[int, int, int]:
    """Collect the young generation every `young` new tracked objects (process-wide); returns the thresholds
    before, for gc.set_threshold(*before) to restore."""
    before = gc.get_threshold()
    gc.set_threshold(young, *before[1:])
    return before


def restore_thresholds(before: tuple[int, int, int]) -> None:
    """Undo set_young_threshold (process-wide)."""
    gc.set_threshold(*before)


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
