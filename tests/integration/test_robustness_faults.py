"""Nothing lost, part A: engine faults, a dead engine, SIGTERM and unload with streams in flight (real tritonserver)."""
from __future__ import annotations

import signal
import threading
import time

import pytest
import requests
import tritonclient.grpc as grpcclient

from backend import Engine, EngineConfig, EngineDead, SamplingParams
from tests.integration.conftest import CPU_PARAMETERS, close_server, launch_server
from tests.integration.test_triton_serving import GrpcStream, grpc_inputs, http_generate, scrape, wait_for

pytestmark = pytest.mark.integration

LONG = {"max_tokens": 40, "temperature": 0, "ignore_eos": True}  # needs more steps than lie between two faults
SHORT = {"max_tokens": 3, "temperature": 0, "ignore_eos": True}  # 3 steps: fits between two faults


def ready(server) -> int:
    return requests.get(f"http://{server.http_url}/v2/models/{server.model_name}/ready", timeout=5).status_code


def kv_idle(server) -> bool:
    return scrape(server, "tandem_kv_cache_blocks_used") == 0 and scrape(server, "tandem_num_requests_running") == 0


def one_grpc(server, prompt: str, sampling: dict, timeout: float = 60):
    stream = GrpcStream(server)
    try:
        stream.send("r", grpc_inputs(prompt, sampling=sampling))
        return stream.wait_all(timeout=timeout)["r"]
    finally:
        stream.close()


# ---- 3. faults: every 7th step raises --------------------------------------------------------------
@pytest.fixture(scope="module")
def faulty_server(tmp_path_factory):
    server = launch_server(tmp_path_factory.mktemp("fault-7"), {**CPU_PARAMETERS, "test_fault_every_n_steps": "7"})
    yield server
    close_server(server)


def test_step_fault_fails_inflight_requests_then_engine_recovers(faulty_server):
    server = faulty_server
    http_answer: list = []
    http_call = threading.Thread(target=lambda: http_answer.append(
        http_generate(server, {"text_input": "Count to fifty:", "parameters": LONG})))
    http_call.start()
    streams = [GrpcStream(server) for _ in range(4)]
    try:
        for i, s in enumerate(streams):
            s.send(f"f{i}", grpc_inputs(f"Story number {i}:", sampling=LONG))
        results = [s.wait_all(timeout=60)[f"f{i}"] for i, s in enumerate(streams)]  # none may hang
    finally:
        for s in streams:
            s.close()
    http_call.join(60)
    for got in results:  # each one final answer: the engine's error (INTERNAL), after any tokens it streamed
        assert got.finals == 1 and len(got.errors) == 1, (got.errors, got.finals)
        message = got.errors[0].message()
        assert "engine error" in message and "injected fault" in message, message
    # INTERNAL; Triton 24.10's /generate reports every error of a response as 400 (gRPC carries the code)
    assert http_answer and http_answer[0].status_code in (400, 500), http_answer
    assert "injected fault" in http_answer[0].json()["error"]
    wait_for(lambda: kv_idle(server), 10, "KV blocks returned after the fault")
    # The engine recovered: faults are 7 steps apart, a 3-step request fits between two of them.
    assert ready(server) == 200
    got = one_grpc(server, "The capital of France is", SHORT)
    assert not got.errors and got.finals == 1 and got.text(), got.errors
    assert scrape(server, "tandem_engine_healthy") == 1
    assert scrape(server, "tandem_requests_total") >= 6


# ---- 3. a dead engine: every step raises, 3 faults in a row stop it ---------------------------------
def _kill_engine(server, pause_s: float = 0.0) -> None:
    """Three requests, one after the other, each failed by its first step: the engine gives up. pause_s between
    them: longer than the loop's idle tick (0.5 s), whose wake-ups must not clear the fault count."""
    for i in range(3):
        if i:
            time.sleep(pause_s)
        got = one_grpc(server, f"Attempt {i}", SHORT)
        assert got.finals == 1 and len(got.errors) == 1, got.errors
        message = got.errors[0].message()
        assert "injected fault" in message or "not healthy" in message, message
    wait_for(lambda: scrape(server, "tandem_engine_healthy") == 0, 10, "the engine to report itself dead")


@pytest.fixture
def dying_server(request, tmp_path_factory):
    unload = request.param  # "true" / "false", or "vllm-true": the vLLM backend's ENABLE_VLLM_HEALTH_CHECK decides
    params = {**CPU_PARAMETERS, "test_fault_every_n_steps": "1", "unload_on_engine_failure": unload}
    if unload == "vllm-true":  # the vLLM backend's name wins over ours
        params.update(unload_on_engine_failure="false", ENABLE_VLLM_HEALTH_CHECK="true")
    server = launch_server(tmp_path_factory.mktemp(f"fault-1-unload-{unload}"), params)
    yield server
    close_server(server)


@pytest.mark.parametrize("dying_server", ["false"], indirect=True)
def test_dead_engine_answers_unavailable_when_it_stays_loaded(dying_server):
    """unload_on_engine_failure false (or model control none/poll): loaded, ready 200, every request UNAVAILABLE."""
    server = dying_server
    _kill_engine(server, pause_s=0.8)  # faults slower than the idle tick still add up
    got = one_grpc(server, "Hello", SHORT)
    assert len(got.errors) == 1 and "engine is not healthy" in got.errors[0].message()
    r = http_generate(server, {"text_input": "Hello", "parameters": SHORT})
    assert r.status_code in (400, 503) and "engine is not healthy" in r.json()["error"], r.text
    assert ready(server) == 200  # Triton 24.10's python backend has no readiness hook: the metric tells
    assert kv_idle(server)


@pytest.mark.parametrize("dying_server", ["true", "vllm-true"], indirect=True)
def test_dead_engine_unloads_itself_so_the_model_is_not_ready(dying_server):
    """Default with explicit model control: the model unloads itself; ready turns 404/400; a load brings it back.
    ENABLE_VLLM_HEALTH_CHECK true (the vLLM backend's health check) does the same, whatever ours says."""
    server = dying_server
    _kill_engine(server)
    wait_for(lambda: ready(server) != 200, 30, "the model to report not ready")
    wait_for(lambda: not server.stub_pids(), 30, "the dead engine's stub to exit")
    r = http_generate(server, {"text_input": "Hello", "parameters": SHORT})
    assert r.status_code != 200 and "llm" in r.json()["error"], r.text  # Triton: unknown / unavailable model
    assert requests.get(f"http://{server.http_url}/v2/health/live", timeout=5).status_code == 200


def test_engine_thread_death_is_detected(tmp_path):
    """A BaseException out of a step kills the loop: requests end with an error, healthy is False, adds fail."""
    from tests.tiny_models import build_tiny

    path = build_tiny("llama", str(tmp_path))
    engine = Engine(EngineConfig(model=path, device="cpu", num_kv_blocks=32, block_size=4, max_num_seqs=4,
                                 max_num_batched_tokens=32))
    try:
        def die() -> None:
            raise SystemExit("test: the loop thread dies")  # not an Exception: _recover cannot catch it

        engine.loop._step = die  # test-only path into the loop thread
        stream = engine.add_request([5, 6, 7], SamplingParams(max_tokens=8, temperature=0))
        final = stream.result()
        assert final.finished and final.finish_reason == "error" and "loop died" in final.error
        engine._thread.join(5)
        assert not engine._thread.is_alive() and not engine.healthy and not engine.stats()["healthy"]
        with pytest.raises(EngineDead):
            engine.add_request([1, 2], SamplingParams(max_tokens=2))
        assert engine.stats()["kv_blocks_used"] == 0
    finally:
        engine.shutdown(timeout=5)


# ---- 4. shutdown with streams in flight --------------------------------------------------------------
# Triton 24.10 drains: on SIGTERM or an unload it stops taking requests and finalizes the model only once every
# request in flight has sent its final response and its gRPC stream is closed. So streams in flight finish
# normally; the adapter's "model is unloading" answer (UNAVAILABLE) covers any request still held at finalize.
# A stream longer than --exit-timeout-secs is cut when Triton gives up waiting (it then exits without a final
# response for it): set the exit timeout above the longest request you serve.
@pytest.fixture
def fresh_server(tmp_path_factory):
    server = launch_server(tmp_path_factory.mktemp("shutdown"), CPU_PARAMETERS, ["--exit-timeout-secs=30"])
    yield server
    close_server(server)


STREAM_TOKENS = 24  # seconds of decoding on a CPU: still running when the signal or the unload comes


def _start_streams(server, n: int = 3) -> GrpcStream:
    stream = GrpcStream(server)
    for i in range(n):
        stream.send(f"s{i}", grpc_inputs(f"Tell a long story number {i}:",
                                         sampling={"max_tokens": STREAM_TOKENS, "temperature": 0, "ignore_eos": True},
                                         return_num_output_tokens=True))
    stream.next_event(timeout=60)  # tokens are flowing
    return stream


def _assert_drained(results: dict) -> None:
    assert len(results) == 3
    for rid, got in results.items():
        assert got.finals == 1 and not got.errors, f"{rid}: {got.finals} finals, errors {got.errors}"
        assert sum(got.output("num_output_tokens")) == STREAM_TOKENS, f"{rid} was cut short"


def test_sigterm_with_streams_in_flight(fresh_server):
    server = fresh_server
    stream = _start_streams(server)
    try:
        server.process.send_signal(signal.SIGTERM)
        results = stream.wait_all(timeout=60)  # a final answer each, no hang
        assert server.process.poll() is None  # still draining: it waits for the streams to close
    finally:
        stream.close()
    _assert_drained(results)
    assert server.process.wait(timeout=30) == 0, "tritonserver did not exit cleanly after draining"
    wait_for(lambda: not server.stub_pids(), 20, "no python-backend stub left after SIGTERM")
    assert "tandem: engine stopped" in server.log_tail(20000)  # finalize ran: the engine shut down in order


def test_unload_with_streams_in_flight(fresh_server):
    server = fresh_server
    client = grpcclient.InferenceServerClient(server.grpc_url)
    stream = _start_streams(server)
    try:
        client.unload_model(server.model_name)
        results = stream.wait_all(timeout=60)
    finally:
        stream.close()  # Triton finishes an unload only once the client's gRPC streams are closed
    _assert_drained(results)
    wait_for(lambda: not client.is_model_ready(server.model_name) and not server.stub_pids(), 60,
             "the model to unload and its stub to exit")
    refused = http_generate(server, {"text_input": "Hi", "parameters": SHORT})
    assert refused.status_code != 200 and "llm" in refused.json()["error"]
    client.close()
