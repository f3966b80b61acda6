"""The Prometheus series the llm model exports, read off model_repository/llm/1/metrics.py itself.

metrics.py registers its families through Triton's Python-backend API (triton_python_backend_utils), which only a
running stub has; here a stand-in records each family's name, and ServingMetrics is built as model.py builds it,
with the vLLM-named series on. A histogram is registered as its _bucket, _sum and _count families."""
from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

METRICS_PY = Path(__file__).resolve().parents[2] / "model_repository" / "llm" / "1" / "metrics.py"


class _RecordingFamily:
    """Stands in for pb_utils.MetricFamily: keeps the names; its metrics take every call and do nothing."""

    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
    names: list[str] = []

    def __init__(self, name: str, description: str, kind: str):
        _RecordingFamily.names.append(name)

    def Metric(self, labels: dict[str, str] | None = None) -> types.SimpleNamespace:  # noqa: N802 (Triton's name)
        return types.SimpleNamespace(increment=lambda value: None, set=lambda value: None)


def exported_series() -> frozenset[str]:
    """Every series name ServingMetrics registers: tandem_* and, with REPORT_CUSTOM_METRICS, vllm:*."""
    saved = sys.modules.get("triton_python_backend_utils")
    sys.modules["triton_python_backend_utils"] = types.SimpleNamespace(MetricFamily=_RecordingFamily)
    _RecordingFamily.names = []
    try:
        spec = importlib.util.spec_from_file_location("llm_metrics_for_deploy_tests", METRICS_PY)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.ServingMetrics("llm", "1", "llm_0_0", vllm_max_model_len=4096)
    finally:
        if saved is None:
            sys.modules.pop("triton_python_backend_utils", None)
        else:
            sys.modules["triton_python_backend_utils"] = saved
    return frozenset(_RecordingFamily.names)
