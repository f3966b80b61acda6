"""Fuzzing the adapter's accept path through a real tritonserver: generated tensors and JSON (deep nesting, huge
numbers, bad UTF-8, wrong types) each get exactly one final response, INVALID_ARG when the request is at fault
(a gRPC stream carries only the error's message: the adapter's INTERNAL messages are told apart by their start);
afterwards no request is running, no KV block is held, and SIGTERM stops the server at once with exit 0."""
from __future__ import annotations

import json
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from hypothesis import HealthCheck, given, settings, strategies as st

from scripts.tritonserver_env import stop_server
from tests.integration.conftest import CPU_PARAMETERS, close_server, launch_server
from tests.integration.test_triton_serving import GrpcStream, scrape, wait_for
from tests.request_strategies import FLAG, RAW_SAMPLING, SAMPLING

pytestmark = pytest.mark.integration

PROMPTS = st.one_of(
    st.binary(max_size=24).map(lambda b: ("text_input", np.array([b], dtype=np.object_), "BYTES")),
    st.lists(st.integers(min_value=-5, max_value=60000), max_size=4).map(
        lambda ids: ("input_ids", np.array(ids, dtype=np.int64), "INT64")),
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = launch_server(tmp_path_factory.mktemp("fuzz"), CPU_PARAMETERS)
    yield server
    if server.process.poll() is None:
        close_server(server)


def _short(sampling: dict) -> bytes:
    """A generated sampling object that runs briefly if valid: at most 3 new tokens, 2 samples."""
    if isinstance(sampling.get("max_tokens"), int) and not isinstance(sampling["max_tokens"], bool):
        sampling["max_tokens"] = max(-1, min(sampling["max_tokens"], 3))
    else:
        sampling.setdefault("max_tokens", 2)
    if isinstance(sampling.get("n"), int):
        sampling["n"] = min(sampling["n"], 2)
    return json.dumps(sampling, allow_nan=True).encode()


def _internal(message: str) -> bool:
    """Whether an error message is one of the adapter's INTERNAL answers (a fault of ours, not of the request)."""
    return message.startswith(("internal error", "could not start the request", "engine error"))


def _tensor(name: str, array: np.ndarray, dtype: str):
    t = grpcclient.InferInput(name, list(array.shape), dtype)
    t.set_data_from_numpy(array)
    return t


@pytest.mark.parametrize("raw, message", [
    ('{"stop": ' + "[" * 1000 + "]" * 1000 + "}", "sampling_parameters: JSON nested too deeply"),
    ('{"seed": 1' + "0" * 5000 + "}", "sampling_parameters: a value is out of range"),
    ('{"temperature": 1' + "0" * 400 + "}", "temperature must be a finite number"),
    (b'{"stop": "\xff\xfe"}', "sampling_parameters must be UTF-8 text"),
], ids=["nested-1000", "5000-digits", "beyond-float", "bad-utf8"])
def test_named_cases_are_invalid_arg_with_a_message(server, raw, message):
    raw = raw if isinstance(raw, bytes) else raw.encode()
    grpc = GrpcStream(server)
    try:
        grpc.send("case", [_tensor("text_input", np.array([b"Hi"], dtype=np.object_), "BYTES"),
                           _tensor("sampling_parameters", np.array([raw], dtype=np.object_), "BYTES")])
        got = grpc.wait_all(timeout=30)["case"]
    finally:
        grpc.close()
    assert got.finals == 1 and len(got.errors) == 1
    assert message in got.errors[0].message()


def test_every_fuzzed_request_gets_one_final_response(server):
    outcomes: dict[str, int] = {}

    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(prompt=PROMPTS, raw=st.none() | RAW_SAMPLING | SAMPLING.map(_short), stream=FLAG)
    def one_request(prompt, raw, stream):
        if raw is not None and raw.startswith(b"{") and b'"max_tokens"' not in raw:
            try:  # a parsable object without max_tokens: keep it short
                raw = _short(json.loads(raw))
            except (ValueError, RecursionError, TypeError):
                pass
        inputs = [_tensor(*prompt)]
        if stream is not None and stream.size:
            inputs.append(_tensor("stream", stream.astype(bool), "BOOL"))
        if raw is not None:
            inputs.append(_tensor("sampling_parameters", np.array([raw], dtype=np.object_), "BYTES"))
        grpc = GrpcStream(server)
        try:
            grpc.send("fuzz", inputs)
            got = grpc.wait_all(timeout=60)["fuzz"]
        finally:
            grpc.close()
        assert got.finals == 1, (prompt, raw)
        for error in got.errors:  # a gRPC stream carries the message, not the code: ours say which it was
            assert not _internal(error.message()), (error.message(), prompt, raw)
        kind = "error" if got.errors else "answered"
        outcomes[kind] = outcomes.get(kind, 0) + 1

    one_request()
    assert outcomes.get("error", 0) > 0  # the fuzzer did reach the refusals
    wait_for(lambda: scrape(server, "tandem_num_requests_running") == 0
             and scrape(server, "tandem_kv_cache_blocks_used") == 0, 20, "the engine to settle")
    started = time.monotonic()
    code = stop_server(server.process)
    assert code == 0 and time.monotonic() - started < 20  # no request left open holds the shutdown
    assert not server.stub_pids()
