"""Python's cyclic garbage collector as the engine sees it: how often it stops every thread, and for how long.

A collection holds the GIL: while it runs, the engine loop cannot launch the next step. A full collection walks
every tracked object of the process, and a served model's process holds millions of them (torch, transformers,
the model's modules), while the output and sender threads create a few objects per token. Freezing the heap
(gc.freeze) after start-up moves everything alive then to the permanent generation, so collections only walk what
was made since; it is thawed when the engine stops, or its frozen reference cycles (CUDA tensors among them) would
never be freed.

Python collects its young generation every 700 new tracked objects by default. A served model makes a few per
token (outputs, responses), and at 256 streams many of them are still queued when a collection comes, so they
survive into the older generations, whose collections then walk them again and again: on the CPU machine, the
stand-in model served at 256 streams spent 0.53-0.60 s of a 3 s run in collections (longest 29-44 ms). A higher
young threshold collects after most of those objects have died (0.03-0.05 s, longest 18-21 ms at 50,000).

Both settings are process-wide, so `GcSettings` counts the engines that asked for them: each engine's start
freezes what is alive then, and the heap is thawed and the threshold restored when the last of them stops.
"""
from __future__ import annotations

import gc
import threading
import time

__all__ = ["GcPauses", "GcSettings"]


class GcSettings:
    """The collector settings of the engines running in this process: frozen heap, young threshold."""

    _lock = threading.Lock()
    _freezers = 0  # running engines that froze the heap
    _young_holders = 0  # running engines that set the young threshold
    _saved_threshold: tuple[int, int, int] = gc.get_threshold()  # Python's, before the first holder set its own

    @classmethod
    def engine_started(cls, freeze: bool, young_threshold: int) -> None:
        """freeze: collect once, then exempt every object alive now from later collections. young_threshold > 0:
        collect the young generation every that many new tracked objects (the first engine's value holds)."""
        with cls._lock:
            if freeze:
                gc.collect()
                gc.freeze()
                cls._freezers += 1
            if young_threshold:
                if cls._young_holders == 0:
                    cls._saved_threshold = gc.get_threshold()
                    gc.set_threshold(young_threshold, *cls._saved_threshold[1:])
                cls._young_holders += 1

    @classmethod
    def engine_stopped(cls, freeze: bool, young_threshold: int) -> None:
        """Undo engine_started with the same arguments; the last engine out thaws and restores."""
        with cls._lock:
            if freeze:
                cls._freezers -= 1
                if cls._freezers == 0:
                    gc.unfreeze()
            if young_threshold:
                cls._young_holders -= 1
                if cls._young_holders == 0:
                    gc.set_threshold(*cls._saved_threshold)


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
