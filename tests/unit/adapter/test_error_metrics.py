"""tandem_request_errors_total (model_repository/llm/1/metrics.py, sender.py) with a stand-in for Triton's
python-backend module: every final error response counts once under its code, from whichever thread sends it;
a cancelled request's close, a failed send and a good response do not count."""
from __future__ import annotations

import importlib.util
import sys
import threading
import types
from pathlib import Path

import pytest

from backend.request import RequestOutput, SamplingParams

MODEL_DIR = Path(__file__).resolve().parents[3] / "model_repository" / "llm" / "1"
ERRORS = "tandem_request_errors_total"
LABELS = {"model": "llm", "version": "1", "instance": "llm_0_0"}


class _Code:
    """A code as the stub's pybind11 enum gives it: with a name."""

    def __init__(self, name: str):
        self.name = name


class _TritonError:
    UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG = _Code("UNKNOWN"), _Code("INTERNAL"), _Code("NOT_FOUND"), \
        _Code("INVALID_ARG")
    UNAVAILABLE, UNSUPPORTED, ALREADY_EXISTS, CANCELLED = _Code("UNAVAILABLE"), _Code("UNSUPPORTED"), \
        _Code("ALREADY_EXISTS"), _Code("CANCELLED")

    def __init__(self, message: str, code: _Code):
        self.message, self.code = message, code


class _Metric:
    def __init__(self, labels: dict):
        self.labels, self.value, self.calls = labels, 0.0, 0

    def increment(self, value: float) -> None:
        self.value += value
        self.calls += 1

    def set(self, value: float) -> None:
        self.value = value


class _Family:
    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
    made: dict[str, "_Family"] = {}

    def __init__(self, name: str, description: str, kind: str):
        self.name, self.metrics = name, []
        _Family.made[name] = self

    def Metric(self, labels: dict) -> _Metric:  # noqa: N802 (Triton's name)
        metric = _Metric(labels)
        self.metrics.append(metric)
        return metric


class _Response:
    def __init__(self, output_tensors=None, error=None):
        self.output_tensors, self.error = output_tensors, error


def _stand_in_pb_utils() -> types.SimpleNamespace:
    log = types.SimpleNamespace(log_info=lambda m: None, log_warn=lambda m: None, log_error=lambda m: None,
                                log_verbose=lambda m: None)
    return types.SimpleNamespace(MetricFamily=_Family, TritonError=_TritonError, InferenceResponse=_Response,
                                 Tensor=lambda name, array: (name, array), Logger=log,
                                 TRITONSERVER_RESPONSE_COMPLETE_FINAL=1)


def _load(monkeypatch, name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def modules(monkeypatch):
    """metrics.py and sender.py, imported against the stand-in."""
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", _stand_in_pb_utils())
    monkeypatch.setattr(_Family, "made", {})
    monkeypatch.syspath_prepend(str(MODEL_DIR))  # sender imports protocol
    return (_load(monkeypatch, "llm_metrics_under_test", MODEL_DIR / "metrics.py"),
            _load(monkeypatch, "llm_sender_under_test", MODEL_DIR / "sender.py"))


def errors_by_code() -> dict[str, float]:
    family = _Family.made[ERRORS]
    for metric in family.metrics:
        assert set(metric.labels) == {*LABELS, "code"} and {k: metric.labels[k] for k in LABELS} == LABELS
    return {metric.labels["code"]: metric.value for metric in family.metrics}


def test_the_codes_the_model_sends_have_series_from_the_start_and_another_code_gets_its_own(modules):
    metrics_py, _ = modules
    metrics = metrics_py.ServingMetrics(**LABELS)
    assert errors_by_code() == {"INVALID_ARG": 0.0, "UNAVAILABLE": 0.0, "INTERNAL": 0.0}
    metrics.request_error(_TritonError.INVALID_ARG)
    metrics.request_error(_TritonError.INVALID_ARG)
    metrics.request_error(_TritonError.UNSUPPORTED)
    assert errors_by_code() == {"INVALID_ARG": 0.0, "UNAVAILABLE": 0.0, "INTERNAL": 0.0}  # only a flush sends
    metrics.flush()
    assert errors_by_code() == {"INVALID_ARG": 2.0, "UNAVAILABLE": 0.0, "INTERNAL": 0.0, "UNSUPPORTED": 1.0}
    calls = sum(m.calls for m in _Family.made[ERRORS].metrics)
    metrics.flush()  # nothing new: no metric call (each is an IPC round trip in the stub)
    assert sum(m.calls for m in _Family.made[ERRORS].metrics) == calls
    assert errors_by_code()["INVALID_ARG"] == 2.0


def test_a_code_is_named_by_its_enum_name_or_else_by_the_module_s_codes(modules, monkeypatch):
    metrics_py, _ = modules
    assert metrics_py.error_code_name(_TritonError.UNAVAILABLE) == "UNAVAILABLE"
    assert metrics_py.error_code_name("INTERNAL") == "INTERNAL"
    plain = types.SimpleNamespace(UNKNOWN=0, INTERNAL=1, NOT_FOUND=2, INVALID_ARG=3, UNAVAILABLE=4)
    monkeypatch.setattr(metrics_py.pb_utils, "TritonError", plain)  # codes without a name: compared
    assert metrics_py.error_code_name(3) == "INVALID_ARG" and metrics_py.error_code_name(4) == "UNAVAILABLE"
    assert metrics_py.error_code_name(99) == "99"


def test_no_count_is_lost_when_threads_count_while_the_sender_flushes(modules):
    """The execute thread (refusals) and the sender thread (engine errors) count while the sender flushes."""
    metrics_py, _ = modules
    metrics = metrics_py.ServingMetrics(**LABELS)
    per_thread, codes = 20_000, [_TritonError.INVALID_ARG, _TritonError.UNAVAILABLE, _TritonError.INTERNAL]
    done = threading.Event()

    def count(code) -> None:
        for _ in range(per_thread):
            metrics.request_error(code)

    def flush() -> None:
        while not done.is_set():
            metrics.flush()

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: a race shows in lost counts
    try:
        flusher = threading.Thread(target=flush)
        flusher.start()
        counters = [threading.Thread(target=count, args=(code,)) for code in codes for _ in range(2)]
        for t in counters:
            t.start()
        for t in counters:
            t.join()
        done.set()
        flusher.join()
    finally:
        sys.setswitchinterval(switch)
    metrics.flush()
    assert errors_by_code() == {"INVALID_ARG": 2 * per_thread, "UNAVAILABLE": 2 * per_thread,
                                "INTERNAL": 2 * per_thread}


# ---- the sender thread's final responses ---------------------------------------------------------------
class _Sender:
    def __init__(self, fail: bool = False):
        self.sent, self.fail = [], fail

    def send(self, response=None, flags: int = 0) -> None:
        if self.fail:
            raise RuntimeError("the client is gone")
        self.sent.append((response, flags))


class _Engine:
    tokenizer = types.SimpleNamespace(decode=lambda ids, **kw: "")
    healthy = True

    def __init__(self):
        self.aborted = []

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def _request(sender_py, request_id: str, sender: _Sender, stream: bool = True):
    from protocol import ParsedRequest

    req = ParsedRequest("Hi", SamplingParams(max_tokens=2), stream, prepend_input=False)
    return sender_py.ActiveRequest(request_id, sender, req, "", 0.0)


def _final(request_id: str, reason: str, error: str | None = None) -> RequestOutput:
    return RequestOutput(request_id, [5], "x", [5], "x", finished=True, finish_reason=reason, num_prompt_tokens=1,
                         error=error)


@pytest.fixture
def loop(modules):
    metrics_py, sender_py = modules
    return sender_py, sender_py.ResponseLoop(_Engine(), metrics_py.ServingMetrics(**LABELS))


def test_engine_errors_and_aborts_count_once_under_their_codes(loop):
    sender_py, loop = loop
    senders = {rid: _Sender() for rid in ("err", "abort", "ok", "gone", "cut")}
    senders["cut"].fail = True
    for rid, sender in senders.items():
        loop.register(_request(sender_py, rid, sender))
    loop._active["gone"].cancelled = True  # its client cancelled: the abort only closes the stream
    for out in (_final("err", "error", "boom"), _final("abort", "abort"), _final("ok", "stop"),
                _final("gone", "abort"), _final("cut", "abort")):
        loop._safe_handle(out)
        loop._safe_handle(out)  # a second final output of an answered request sends nothing
    loop._metrics.flush()
    assert errors_by_code() == {"INVALID_ARG": 0.0, "UNAVAILABLE": 1.0, "INTERNAL": 1.0}
    assert [len(s.sent) for s in senders.values()] == [1, 1, 1, 1, 0]
    assert senders["gone"].sent == [(None, 1)]  # closed without an error
    finished = {m.labels["finish_reason"]: m.value for m in _Family.made["tandem_requests_total"].metrics}
    assert finished == {"stop": 1.0, "length": 0.0, "abort": 3.0, "error": 1.0}  # finish reasons as before


def test_a_failed_start_and_a_stopped_engine_count_their_codes(loop):
    sender_py, loop = loop
    for rid in ("bad", "full", "a", "b", "cancelled"):
        loop.register(_request(sender_py, rid, _Sender()))
    loop.fail("bad", "prompt has 2000 token ids", _TritonError.INVALID_ARG)
    loop.fail("full", "server overloaded", _TritonError.UNAVAILABLE)
    loop.fail("nobody", "already answered", _TritonError.INTERNAL)  # not registered: nothing is sent or counted
    for item in loop._drain():
        loop._safe_handle(item)
    loop._active["cancelled"].cancelled = True
    loop._fail_all("engine stopped; see the server log", _TritonError.INTERNAL)
    loop.error_sent(_TritonError.INVALID_ARG)  # a refusal sent by execute()
    loop._metrics.flush()
    assert errors_by_code() == {"INVALID_ARG": 2.0, "UNAVAILABLE": 1.0, "INTERNAL": 2.0}
    assert loop.in_flight() == 0
