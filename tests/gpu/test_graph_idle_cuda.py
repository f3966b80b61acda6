"""Graph idle measured after capture on CUDA: every captured graph has its idle time, and without it the timeline
counts graph replays as uncertain."""
from __future__ import annotations

import math

import pytest

from backend import Engine, EngineConfig, SamplingParams
from tests.tiny_models import build_tiny, random_prompts

pytestmark = pytest.mark.gpu


def _engine(tmp_path, **kw) -> Engine:
    path = build_tiny("llama", str(tmp_path))
    return Engine(EngineConfig(model=path, device="cuda", dtype="float32", num_kv_blocks=256, max_num_seqs=16,
                               max_num_batched_tokens=256, attention_backend="triton", **kw))


@pytest.mark.parametrize("speculation", [{}, dict(speculative_method="ngram", num_speculative_tokens=4)],
                         ids=["plain", "speculative"])
def test_every_captured_graph_has_its_idle_time(tmp_path, speculation):
    """Speculation adds verify graphs: 16 sequences of 5 positions are 80 logits rows, the 32- to 128-token ones."""
    engine = _engine(tmp_path, **speculation)
    try:
        graphs = engine.runner.graphs
        assert graphs.verify_buckets == ([32, 64, 128] if speculation else [])
        want = {("decode", b) for b in graphs.buckets} | {("mixed", t) for t in graphs.token_buckets}
        want |= {("verify", t) for t in graphs.verify_buckets}
        if graphs.samples:
            want |= {("sampler", b, k) for b in graphs.buckets for k in (True, False)}
        assert graphs.idle is not None and set(graphs.idle) == want
        assert all(math.isfinite(v) and 0.0 <= v < 0.01 for v in graphs.idle.values()), graphs.idle
    finally:
        engine.shutdown()


@pytest.mark.parametrize("measure", [True, False])
def test_graph_replays_count_as_busy_less_their_idle_only_where_it_was_measured(tmp_path, measure):
    engine = _engine(tmp_path, graph_idle_measure=measure, timeline=True)
    try:
        assert (engine.runner.graphs.idle is None) is not measure
        engine.generate(random_prompts([5] * 8, seed=1), SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
        summary = engine.timeline.summary()
        busy, uncertain = summary["gpu_busy_fraction"], summary["gpu_busy_uncertain_fraction"]
        # nearly every step replays graphs: measured, their spans are busy time; not, they are uncertain
        assert (busy > uncertain) if measure else (uncertain > busy), summary
    finally:
        engine.shutdown()
