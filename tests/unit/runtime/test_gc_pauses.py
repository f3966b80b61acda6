"""Garbage-collector pauses: counted per generation, and the start-up heap frozen for an engine's life only."""
from __future__ import annotations

import gc

from backend import Engine, EngineConfig, SamplingParams
from backend.runtime.gc_pauses import GcPauses, GcSettings
from tests.tiny_models import build_tiny


def test_pauses_are_counted_per_generation():
    pauses = GcPauses()
    try:
        gc.collect(0)
        gc.collect(2)
        gc.collect(2)
        snap = pauses.snapshot()
    finally:
        pauses.close()
    assert snap["gc_collections"][0] >= 1 and snap["gc_collections"][2] >= 2  # other threads may collect too
    assert snap["gc_pause_s"] > 0 and 0 < snap["gc_longest_pause_ms"] <= snap["gc_pause_s"] * 1e3
    gc.collect(2)
    assert pauses.snapshot() == snap  # closed: no longer counting


def test_engine_freezes_the_heap_while_it_runs(tmp_path):
    """gc_freeze (default): the objects alive at start-up are frozen while the engine runs, and thawed at its
    shutdown, so a stopped engine's reference cycles can be collected; the young generation's threshold is the
    engine's while it runs and Python's again after. The stats carry the pauses."""
    path = build_tiny("llama", str(tmp_path))
    before = gc.get_threshold()
    engine = Engine(EngineConfig(model=path, num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=64))
    try:
        assert gc.get_freeze_count() > 1000
        assert gc.get_threshold()[0] == 50_000  # gc_young_threshold's default, while the engine runs
        engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))
        assert {"gc_collections", "gc_pause_s", "gc_longest_pause_ms"} <= set(engine.stats())
        gc.collect(0)
        assert engine.gc_pauses.snapshot()["gc_collections"][0] >= 1
    finally:
        engine.shutdown()
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == before
    engine = Engine(EngineConfig(model=path, num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=64,
                                 gc_freeze=False, gc_young_threshold=0))
    try:
        assert gc.get_freeze_count() == 0 and gc.get_threshold() == before
    finally:
        engine.shutdown()


def test_settings_hold_until_the_last_engine_stops():
    """Two engines in one process: the first to stop neither thaws the other's frozen heap nor restores the
    threshold under it; the last one out does both."""
    before = gc.get_threshold()
    GcSettings.engine_started(True, 12_345)
    GcSettings.engine_started(True, 50_000)  # freezes its own start-up objects too; the first threshold holds
    try:
        assert gc.get_threshold() == (12_345, *before[1:]) and gc.get_freeze_count() > 0
        GcSettings.engine_stopped(True, 12_345)
        assert gc.get_threshold() == (12_345, *before[1:]) and gc.get_freeze_count() > 0
    finally:
        GcSettings.engine_stopped(True, 50_000)
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0
