"""The engine's figures for metrics, refreshed by the loop after each step and read from any thread."""
from __future__ import annotations


class EngineStats:
    """A snapshot dict replaced whole by the loop (readers see one step's figures, never a half-written one)."""

    _GPU_KEYS = ("gpu_busy_fraction", "gpu_busy_uncertain_fraction")
    _GPU_EVERY = 256  # steps between reads of the timeline's busy figures

    def __init__(self, scheduler, block_manager, timeline, speculator=None):
        self._scheduler = scheduler
        self._speculator = speculator  # its draft counts join the figures where the engine speculates
        self._blocks = block_manager
        self._timeline = timeline
        self._snapshot: dict = {}

    def refresh(self, steps: int) -> None:
        bm, sch = self._blocks, self._scheduler
        snap = {
            "running": len(sch.running),
            "waiting": len(sch.waiting),
            "kv_blocks_used": bm.num_used_blocks,
            "kv_blocks_total": bm.num_usable_blocks,
            "kv_usage": bm.usage(),
            "prefix_cache_queries": bm.prefix_queries,
            "prefix_cache_hits": bm.prefix_hits,
            "prefix_cache_hit_rate": bm.hit_rate(),
            "preemptions": sch.num_preemptions,
            "steps": steps,
        }
        if self._speculator is not None:
            snap.update(self._speculator.counts())
        if self._timeline.enabled and steps % self._GPU_EVERY == 0 and steps:
            # O(1): a summary over 256 steps' spans (and resolving their events at once) stalled the loop for ms
            snap["gpu_busy_fraction"] = self._timeline.recent_busy_fraction()  # exact spans: kernel time
            snap["gpu_busy_uncertain_fraction"] = self._timeline.recent_uncertain_fraction()  # same 256 steps
        elif "gpu_busy_fraction" in self._snapshot:
            snap.update({key: self._snapshot[key] for key in self._GPU_KEYS})
        self._snapshot = snap

    def snapshot(self) -> dict:
        return dict(self._snapshot)
