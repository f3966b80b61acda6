"""Speculative decoding's Prometheus series (model_repository/llm/1/metrics.py) with a stand-in for Triton's
python-backend module: made only once the engine reports speculation, each a counter that grows by what the engine's
running totals grew, per draft position too, and under the vLLM backend's names where those are on."""
from __future__ import annotations

import sys

import pytest

from tests.unit.adapter.test_error_metrics import LABELS, MODEL_DIR, _Family, _load, _stand_in_pb_utils


@pytest.fixture
def metrics_py(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", _stand_in_pb_utils())
    monkeypatch.setattr(_Family, "made", {})
    return _load(monkeypatch, "llm_metrics_for_speculation", MODEL_DIR / "metrics.py")


def _values(name: str) -> dict:
    return {m.labels.get("position"): m.value for m in _Family.made[name].metrics}


def _stats(drafts, proposed, accepted, per_position):
    return {"spec_drafts": drafts, "spec_proposed_tokens": proposed, "spec_accepted_tokens": accepted,
            "spec_steps": drafts, "spec_accepted_per_position": per_position}


@pytest.mark.parametrize("vllm", [False, True])
def test_speculation_counters_follow_the_engine_totals(metrics_py, vllm):
    metrics = metrics_py.ServingMetrics(**LABELS, vllm_max_model_len=4096 if vllm else None)
    metrics.update_engine({"running": 1})
    assert not any(name.startswith(("tandem_spec", "vllm:spec")) for name in _Family.made)
    metrics.update_engine(_stats(3, 12, 5, [3, 2, 0, 0]))
    metrics.update_engine(_stats(3, 12, 5, [3, 2, 0, 0]))  # nothing new: nothing added
    metrics.update_engine(_stats(7, 28, 14, [7, 4, 2, 1]))
    names = [("tandem_spec_decode_drafts_total", "vllm:spec_decode_num_drafts_total", 7),
             ("tandem_spec_decode_draft_tokens_total", "vllm:spec_decode_num_draft_tokens_total", 28),
             ("tandem_spec_decode_accepted_tokens_total", "vllm:spec_decode_num_accepted_tokens_total", 14)]
    for ours, theirs, want in names:
        assert _values(ours) == {None: want}
        assert (theirs in _Family.made) == vllm
        if vllm:
            assert _values(theirs) == {None: want}
    per_position = {"0": 7, "1": 4, "2": 2, "3": 1}
    assert _values("tandem_spec_decode_accepted_tokens_per_position_total") == per_position
    if vllm:
        assert _values("vllm:spec_decode_num_accepted_tokens_per_pos") == per_position
    for metric in _Family.made["tandem_spec_decode_drafts_total"].metrics:
        assert metric.labels == LABELS and metric.calls == 2
