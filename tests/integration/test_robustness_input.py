"""Nothing lost, part A: bad input, overload and request limits against a real tritonserver; security basics."""
from __future__ import annotations

import json
import queue
import re
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient

from backend import Engine, EngineConfig, SamplingParams
from tests.integration.conftest import close_server, launch_server
from tests.integration.test_triton_serving import (
    GrpcStream, grpc_inputs, http_generate, run_on_streams, scrape, wait_for,
)

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
MAX_LEN = 1024  # max_model_len of the session server (conftest.CPU_PARAMETERS)
VOCAB = 49152  # SmolLM2's vocabulary
OK = {"max_tokens": 2, "temperature": 0}


def sp(**values) -> str:
    """A sampling_parameters tensor (JSON text): lists such as stop only travel this way over HTTP."""
    return json.dumps({"max_tokens": 2, **values})


def assert_idle(server) -> None:
    """The server still answers, and no KV block or request is left behind."""
    assert requests.get(f"http://{server.http_url}/v2/models/{server.model_name}/ready", timeout=5).status_code == 200
    wait_for(lambda: scrape(server, "tandem_kv_cache_blocks_used") == 0
             and scrape(server, "tandem_num_requests_running") == 0
             and scrape(server, "tandem_num_requests_waiting") == 0, 10, "KV blocks and queues back to zero")


# ---- 1. bad input over HTTP: INVALID_ARG (400) with a message naming the field and what is allowed -------
BAD_HTTP = {
    "no_prompt": ({"parameters": OK}, ["text_input", "input_ids"]),
    "both_prompts": ({"text_input": "Hi", "input_ids": [1, 2], "parameters": OK}, ["text_input", "input_ids"]),
    "empty_text": ({"text_input": "", "parameters": OK}, ["text_input", "non-empty"]),
    "text_without_tokens": ({"text_input": "\x1d", "parameters": OK}, ["prompt", "no tokens"]),  # dropped whole
    "prompt_too_long_text": ({"text_input": "hello " * (MAX_LEN + 50), "parameters": OK}, ["prompt", str(MAX_LEN)]),
    "prompt_too_long_ids": ({"input_ids": [17] * (MAX_LEN + 5), "parameters": OK}, ["prompt", str(MAX_LEN)]),
    "prompt_megabytes": ({"text_input": "x" * 3_000_000, "parameters": OK}, ["prompt", "characters"]),
    "max_tokens_zero": ({"text_input": "Hi", "parameters": {"max_tokens": 0}}, ["max_tokens", ">= 1"]),
    "max_tokens_negative": ({"text_input": "Hi", "parameters": {"max_tokens": -3}}, ["max_tokens", ">= 1"]),
    "max_tokens_beyond_max": ({"text_input": "Hi", "parameters": {"max_tokens": MAX_LEN}}, ["max_tokens", str(MAX_LEN)]),
    "max_tokens_not_int": ({"text_input": "Hi", "parameters": {"max_tokens": 2.5}}, ["max_tokens", "integer"]),
    "min_tokens_over_max": ({"text_input": "Hi", "parameters": {"max_tokens": 2, "min_tokens": 3}}, ["min_tokens"]),
    "temperature_negative": ({"text_input": "Hi", "parameters": {"temperature": -0.5}}, ["temperature", "[0.0, 100.0]"]),
    "temperature_text": ({"text_input": "Hi", "parameters": {"temperature": "hot"}}, ["temperature", "number"]),
    "top_p_zero": ({"text_input": "Hi", "parameters": {"top_p": 0}}, ["top_p", "(0.0, 1.0]"]),
    "top_p_above_one": ({"text_input": "Hi", "parameters": {"top_p": 1.5}}, ["top_p", "(0.0, 1.0]"]),
    "top_k_below_minus_one": ({"text_input": "Hi", "parameters": {"top_k": -2}}, ["top_k", ">= -1"]),
    "min_p_negative": ({"text_input": "Hi", "parameters": {"min_p": -0.1}}, ["min_p", "[0.0, 1.0]"]),
    "min_p_above_one": ({"text_input": "Hi", "parameters": {"min_p": 1.1}}, ["min_p", "[0.0, 1.0]"]),
    "repetition_penalty_zero": ({"text_input": "Hi", "parameters": {"repetition_penalty": 0}},
                                ["repetition_penalty", "(0.0, 10.0]"]),
    "presence_penalty_high": ({"text_input": "Hi", "parameters": {"presence_penalty": 2.5}},
                              ["presence_penalty", "[-2.0, 2.0]"]),
    "frequency_penalty_low": ({"text_input": "Hi", "parameters": {"frequency_penalty": -3}},
                              ["frequency_penalty", "[-2.0, 2.0]"]),
    "seed_negative": ({"text_input": "Hi", "parameters": {"seed": -1}}, ["seed", "[0, 18446744073709551615]"]),
    "seed_beyond_64_bits": ({"text_input": "Hi", "sampling_parameters": sp(seed=2**64)},
                            ["seed must be in [0, 18446744073709551615]", "2**64 - 1", "18446744073709551616"]),
    "seed_plus_n_beyond_64_bits": ({"text_input": "Hi", "sampling_parameters": sp(seed=2**64 - 1, n=2)},
                                   ["seed + n - 1 must be at most 18446744073709551615"]),
    "logprobs_too_many": ({"text_input": "Hi", "parameters": {"logprobs": 21}}, ["logprobs", "[0, 20]"]),
    "bool_as_text": ({"text_input": "Hi", "parameters": {"ignore_eos": "maybe"}}, ["ignore_eos", "true or false"]),
    "malformed_json": ({"text_input": "Hi", "sampling_parameters": '{"max_tokens": 4'},
                       ["sampling_parameters", "malformed JSON"]),
    "json_list": ({"text_input": "Hi", "sampling_parameters": "[1, 2]"}, ["sampling_parameters", "JSON object"]),
    "json_string": ({"text_input": "Hi", "sampling_parameters": '"fast"'}, ["sampling_parameters", "JSON object"]),
    "unknown_key": ({"text_input": "Hi", "parameters": {"max_tokenz": 4}}, ["max_tokenz", "allowed"]),
    "unknown_key_tensor": ({"text_input": "Hi", "sampling_parameters": sp(beam_width=2)}, ["beam_width", "allowed"]),
    "token_id_too_big": ({"input_ids": [1, VOCAB], "parameters": OK}, ["token id", f"[0, {VOCAB})"]),
    "token_id_negative": ({"input_ids": [-1, 5], "parameters": OK}, ["token id", f"[0, {VOCAB})"]),
    "stop_token_id_too_big": ({"text_input": "Hi", "sampling_parameters": sp(stop_token_ids=[VOCAB + 1])},
                              ["stop_token_ids", str(VOCAB)]),
    "too_many_stop_strings": ({"text_input": "Hi", "sampling_parameters": sp(stop=[f"s{i}" for i in range(17)])},
                              ["stop", "at most 16"]),
    "stop_string_too_long": ({"text_input": "Hi", "sampling_parameters": sp(stop=["x" * 257])},
                             ["stop", "at most 256"]),
    "empty_stop_string": ({"text_input": "Hi", "sampling_parameters": sp(stop=[""])}, ["stop", "non-empty"]),
    "exclude_false_when_streaming": ({"text_input": "Hi", "stream": True, "exclude_input_in_output": False},
                                     ["exclude_input_in_output"]),
}


@pytest.mark.parametrize("body, words", list(BAD_HTTP.values()), ids=list(BAD_HTTP))
def test_bad_http_input_is_invalid_arg(triton_server, body, words):
    started = time.monotonic()
    response = http_generate(triton_server, body)
    assert response.status_code == 400, response.text
    message = response.json()["error"]
    assert all(w in message for w in words), message
    assert time.monotonic() - started < 5, "a refusal must not wait for the engine"
    assert_idle(triton_server)


# Triton's HTTP frontend checks JSON types and shapes against config.pbtxt before our code runs; we only check
# that its answer is an error naming the input, and that the server keeps serving.
TRITON_HTTP = {
    "text_input_two_strings": ({"text_input": ["Hi", "Ho"], "parameters": OK}, 400, "text_input"),
    "input_ids_floats": ({"input_ids": [1.5, 2.0], "parameters": OK}, 500, "signed-integer"),
    "stream_as_int": ({"text_input": "Hi", "stream": 1, "parameters": OK}, 500, "boolean"),
    "parameters_not_object": ({"text_input": "Hi", "parameters": "fast"}, 500, "parameters"),
    "stop_list_as_parameter": ({"text_input": "Hi", "parameters": {"max_tokens": 2, "stop": ["a"]}}, 400, "stop"),
}


@pytest.mark.parametrize("body, status, word", list(TRITON_HTTP.values()), ids=list(TRITON_HTTP))
def test_http_input_triton_rejects(triton_server, body, status, word):
    response = http_generate(triton_server, body)
    assert response.status_code == status, response.text
    assert word in response.json()["error"]
    assert_idle(triton_server)


def _tensor(name: str, array: np.ndarray, dtype: str):
    t = grpcclient.InferInput(name, list(array.shape), dtype)
    t.set_data_from_numpy(array)
    return t


def _text(value: bytes):
    return _tensor("text_input", np.array([value], dtype=np.object_), "BYTES")


# Over gRPC a stream error carries its message only (no status code reaches tritonclient's stream callback).
BAD_GRPC = {
    "invalid_utf8": ([_text(b"caf\xe9 \xff\xfe")], ["text_input", "UTF-8"]),
    "empty_input_ids": ([_tensor("input_ids", np.zeros((0,), np.int64), "INT64")], ["input_ids", "at least one"]),
    # rejected by Triton itself (dtype / shape against config.pbtxt):
    "input_ids_fp32": ([_tensor("input_ids", np.array([1, 2], np.float32), "FP32")], ["input_ids", "FP32", "INT64"]),
    "input_ids_2d": ([_tensor("input_ids", np.ones((2, 2), np.int64), "INT64")], ["input_ids", "shape"]),
    "text_input_two": ([_tensor("text_input", np.array([b"a", b"b"], np.object_), "BYTES")], ["text_input", "shape"]),
    "stream_int32": ([_text(b"Hi"), _tensor("stream", np.array([1], np.int32), "INT32")], ["stream", "INT32", "BOOL"]),
    "stream_two": ([_text(b"Hi"), _tensor("stream", np.array([True, False]), "BOOL")], ["stream", "shape"]),
}


@pytest.mark.parametrize("inputs, words", list(BAD_GRPC.values()), ids=list(BAD_GRPC))
def test_bad_grpc_input_is_an_error(triton_server, inputs, words):
    stream = GrpcStream(triton_server)
    try:
        stream.send("bad", inputs)
        got = stream.wait_all(timeout=30)["bad"]
    finally:
        stream.close()
    assert len(got.errors) == 1 and not got.responses and got.finals == 1
    message = got.errors[0].message()
    assert all(w in message for w in words), message
    assert_idle(triton_server)


def test_stream_true_on_http_generate_is_a_clear_error(triton_server):
    """/generate takes exactly one response; a streaming request there gets Triton's own error, nothing hangs.

    The adapter cannot tell /generate from /generate_stream (both hand it the same request), so it streams as
    asked; at the second response Triton answers the HTTP call with an error that points to generate_stream
    (HTTP status 200 in Triton 24.10). Later sends still succeed, so the request runs to max_tokens and ends.
    """
    body = {"text_input": "Tell me a story", "stream": True, "parameters": {"max_tokens": 24, "ignore_eos": True}}
    response = http_generate(triton_server, body)
    assert "generate stream" in response.json()["error"], response.text
    assert_idle(triton_server)  # the request ends (at max_tokens: the adapter cannot see the HTTP error)
    good = http_generate(triton_server, {"text_input": "Hi", "parameters": OK})
    assert good.status_code == 200 and good.json()["text_output"].startswith("Hi")


def test_server_serves_after_bad_input(triton_server):
    good = GrpcStream(triton_server)
    try:
        good.send("good", grpc_inputs("Hi", sampling=OK))
        got = good.wait_all(timeout=60)["good"]
    finally:
        good.close()
    assert not got.errors and got.finals == 1 and got.text()
    assert_idle(triton_server)


# ---- 2. overload -----------------------------------------------------------------------------------
OVERLOAD_PROMPTS = [f"Question {i}: what is {i} plus {i + 1}? Think step by step and explain your answer in "
                    f"simple words for a child." for i in range(16)]
OVERLOAD_SAMPLING = {"max_tokens": 24, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def small_kv_server(tmp_path_factory):
    """KV cache for 512 tokens, 16 running requests of ~55 tokens each: they must queue and be preempted."""
    params = {"device": "cpu", "num_kv_blocks": "32", "block_size": "16", "max_num_seqs": "32",
              "max_num_batched_tokens": "512", "max_model_len": "512", "stats_interval_s": "0.2"}
    server = launch_server(tmp_path_factory.mktemp("small-kv"), params)
    yield server
    close_server(server)


def test_kv_pressure_queues_and_preempts_and_matches_offline(small_kv_server):
    engine = Engine(EngineConfig(device="cpu", num_kv_blocks=512, max_num_seqs=16, max_model_len=512))
    try:
        want = [o.token_ids for o in engine.generate(OVERLOAD_PROMPTS, SamplingParams(**OVERLOAD_SAMPLING))]
    finally:
        engine.shutdown()
    results = run_on_streams(small_kv_server, {
        f"o{i}": grpc_inputs(prompt, sampling=OVERLOAD_SAMPLING, return_output_ids=True)
        for i, prompt in enumerate(OVERLOAD_PROMPTS)})
    bad = {rid: got.errors for rid, got in results.items() if got.errors or got.finals != 1}
    assert not bad, f"requests that failed under KV pressure: {bad}"
    wrong = [i for i in range(len(OVERLOAD_PROMPTS)) if results[f"o{i}"].output("output_ids") != want[i]]
    assert not wrong, f"outputs that differ from the engine's offline greedy run: {wrong}"
    assert scrape(small_kv_server, "tandem_preemptions_total") > 0, "the KV cache was never short: no preemption"
    assert_idle(small_kv_server)


@pytest.fixture(scope="module")
def bounded_queue_server(tmp_path_factory):
    """At most 2 running + 4 waiting requests; log_prompts on (the positive control of the log test)."""
    params = {"device": "cpu", "num_kv_blocks": "128", "max_num_seqs": "2", "max_num_batched_tokens": "256",
              "max_model_len": "512", "max_waiting_requests": "4", "stats_interval_s": "0.2", "log_prompts": "true"}
    server = launch_server(tmp_path_factory.mktemp("bounded-queue"), params)
    yield server
    close_server(server)


def _burst(server, n: int, prompt: str) -> list[tuple[int, dict, float]]:
    """n requests at once over HTTP, 16 greedy tokens each: (status, body, seconds) of every answer."""
    answers: queue.Queue = queue.Queue()

    def call(i: int) -> None:
        started = time.monotonic()
        r = http_generate(server, {"text_input": f"{prompt} {i} says", "exclude_input_in_output": True,
                                   "parameters": {"max_tokens": 16, "temperature": 0, "ignore_eos": True}})
        answers.put((r.status_code, r.json(), time.monotonic() - started))

    threads = [threading.Thread(target=call, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    got = [answers.get_nowait() for _ in range(answers.qsize())]
    assert len(got) == n, "some requests never got an answer"
    return got


def test_burst_beyond_the_queue_is_refused_with_unavailable(bounded_queue_server):
    server, n = bounded_queue_server, 16
    got = _burst(server, n, "Burst request")
    accepted = [body for status, body, _ in got if status == 200]
    refused = [(status, body, secs) for status, body, secs in got if status != 200]
    assert 1 <= len(accepted) <= 6 and len(refused) >= n - 6, got  # 2 running + 4 waiting at most
    assert all(len(body["text_output"]) > 0 for body in accepted)
    for status, body, secs in refused:
        # UNAVAILABLE; Triton 24.10's /generate reports every error of a response as 400 (gRPC carries the code)
        assert status in (400, 503), body
        assert "overloaded" in body["error"] and "retry" in body["error"], body
        assert secs < 10, f"a refusal took {secs:.1f} s: it must not wait for the queue"
    assert_idle(server)


# ---- error responses by code: tandem_request_errors_total ---------------------------------------------
CODES = ("INVALID_ARG", "UNAVAILABLE", "INTERNAL")


def error_counts(server) -> dict[str, float | None]:
    """tandem_request_errors_total of this model per code (None: no such series)."""
    text = urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()
    counts: dict[str, float | None] = dict.fromkeys(CODES)
    for labels, value in re.findall(r"^tandem_request_errors_total\{([^}]*)\} ([0-9.eE+-]+)$", text, re.M):
        code = re.search(r'code="([^"]*)"', labels)
        if f'model="{server.model_name}"' in labels and code:
            counts[code.group(1)] = (counts.get(code.group(1)) or 0.0) + float(value)
    return counts


def settled_error_counts(server) -> dict[str, float | None]:
    """The counts once the model's 0.1 s flush has sent every count (two equal readings 0.3 s apart)."""
    counts = error_counts(server)
    while True:
        time.sleep(0.3)
        again = error_counts(server)
        if again == counts:
            return counts
        counts = again


def test_invalid_input_counts_one_invalid_arg_and_good_requests_count_nothing(triton_server):
    server = triton_server
    before = settled_error_counts(server)
    assert None not in before.values(), before  # the codes the model sends have their series from the load on
    good = http_generate(server, {"text_input": "Hi", "parameters": OK})
    assert good.status_code == 200, good.text
    assert settled_error_counts(server) == before

    # refused in execute() (the request parser)
    bad = http_generate(server, {"text_input": "Hi", "sampling_parameters": '{"max_tokens": 4'})
    assert bad.status_code == 400 and "malformed JSON" in bad.json()["error"], bad.text
    wait_for(lambda: error_counts(server)["INVALID_ARG"] > before["INVALID_ARG"], 10, "the INVALID_ARG count")
    assert settled_error_counts(server) == {**before, "INVALID_ARG": before["INVALID_ARG"] + 1}

    # refused by the engine's admission, answered by the sender thread; over gRPC, which carries no code
    stream = GrpcStream(server)
    try:
        stream.send("long", grpc_inputs(ids=[17] * (MAX_LEN + 5), sampling=OK))
        got = stream.wait_all(timeout=30)["long"]
    finally:
        stream.close()
    assert len(got.errors) == 1 and "maximum model length" in got.errors[0].message(), got.errors
    wait_for(lambda: error_counts(server)["INVALID_ARG"] > before["INVALID_ARG"] + 1, 10, "the INVALID_ARG count")
    assert settled_error_counts(server) == {**before, "INVALID_ARG": before["INVALID_ARG"] + 2}

    # Triton itself refuses a wrong type against config.pbtxt: the model never sees it, so it is not counted here
    refused = http_generate(server, {"input_ids": [1.5, 2.0], "parameters": OK})
    assert refused.status_code == 500, refused.text
    good = http_generate(server, {"text_input": "Hello", "parameters": OK})
    assert good.status_code == 200, good.text
    assert settled_error_counts(server) == {**before, "INVALID_ARG": before["INVALID_ARG"] + 2}


def test_requests_refused_by_a_full_queue_count_as_unavailable(bounded_queue_server):
    server, n = bounded_queue_server, 12
    before = settled_error_counts(server)
    got = _burst(server, n, "Counted burst")
    refused = [body for status, body, _ in got if status != 200]
    assert len(refused) >= n - 6, got  # 2 running + 4 waiting at most
    assert all("overloaded" in body["error"] for body in refused), refused
    assert_idle(server)
    assert settled_error_counts(server) == {**before, "UNAVAILABLE": before["UNAVAILABLE"] + len(refused)}


# ---- 5. security basics ----------------------------------------------------------------------------
PRODUCT_DIRS = ("backend", "bench", "model_repository", "client", "loadtest", "scripts")


def _product_sources() -> list[Path]:
    return [p for d in PRODUCT_DIRS for p in (REPO / d).rglob("*.py") if "__pycache__" not in p.parts]


def test_no_remote_code_and_no_pickle_loading_in_the_product():
    offenders = []
    patterns = [re.compile(r"trust_remote_code\s*=\s*True"), re.compile(r"torch\.load\("),
                re.compile(r"pickle\.loads?\("), re.compile(r"weights_only\s*=\s*False")]
    for path in _product_sources():
        text = path.read_text(errors="replace")
        offenders += [f"{path.relative_to(REPO)}: {p.pattern}" for p in patterns if p.search(text)]
    assert not offenders, offenders


def test_weights_only_from_safetensors_and_known_places(tmp_path):
    import torch

    from tests.tiny_models import build_tiny

    tiny = Path(build_tiny("llama", str(tmp_path)))
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    for f in tiny.iterdir():  # config and tokenizer, but the weights only as a pickle
        if f.is_file() and f.suffix != ".safetensors":
            (pickled / f.name).write_bytes(f.read_bytes())
    torch.save({"w": torch.zeros(1)}, pickled / "pytorch_model.bin")
    with pytest.raises(ValueError, match="pickle"):
        Engine(EngineConfig(model=str(pickled), device="cpu", num_kv_blocks=8))
    for name in (str(tmp_path / "no-such-folder"), "HuggingFaceTB/SmolLM2-135M-Instruct", "https://example.com/m"):
        with pytest.raises(ValueError, match="local checkpoint folder"):
            Engine(EngineConfig(model=name, device="cpu", num_kv_blocks=8))


def test_prompt_text_is_logged_only_when_asked(triton_server, bounded_queue_server):
    secret = "zebra-quartz-7731 is my password"
    for server in (triton_server, bounded_queue_server):
        r = http_generate(server, {"text_input": secret, "parameters": OK})
        assert r.status_code == 200, r.text
        bad = http_generate(server, {"text_input": secret, "parameters": {"max_tokens": 0}})
        assert bad.status_code == 400 and secret not in bad.json()["error"]  # errors do not echo the prompt
    time.sleep(0.5)  # the log is written by the server process
    assert secret not in triton_server.log_path.read_text(errors="replace")  # log_prompts: false (default)
    assert secret in bounded_queue_server.log_path.read_text(errors="replace")  # log_prompts: true


def test_metrics_report_kv_usage_for_this_model(triton_server):
    text = urllib.request.urlopen(triton_server.metrics_url, timeout=5).read().decode()
    assert re.search(r'^tandem_kv_cache_blocks_used\{[^}]*model="llm"', text, re.M)
    assert re.search(r'^tandem_engine_healthy\{[^}]*model="llm"[^}]*\} 1', text, re.M)
