"""Client and load-test logic without a server: SSE, request building, responses, errors, reports."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tandem_client import GenerateRequest, TandemConnectionError, TandemError
from tandem_client.collect import Collector
from tandem_client.errors import from_grpc, from_http
from tandem_client.request import http_body, sampling_parameters, tensors
from tandem_client.response import chunk_from_grpc, chunk_from_json, error_message_from_body
from tandem_client.schema import Chunk, Result
from tandem_client.sse import SSEDecoder, iter_events
from tandem_client.urls import grpc_target, http_base
from loadtest.metrics import entries
from loadtest.report import check_slos, from_locust_csv, from_samples, summarize, table

REPO = Path(__file__).resolve().parents[3]


# --- SSE -------------------------------------------------------------------------------------------
def test_sse_events_split_on_blank_lines():
    lines = ['data: {"a": 1}', "", 'data: {"b": 2}', "", ""]
    assert list(iter_events(lines)) == ['{"a": 1}', '{"b": 2}']


def test_sse_ignores_comments_and_other_fields_and_joins_multiline_data():
    lines = [b": keep-alive\r\n", b"event: message\r\n", b"data: line1\r\n", b"data:line2\r\n", b"\r\n"]
    assert list(iter_events(lines)) == ["line1\nline2"]


def test_sse_flushes_an_unterminated_last_event():
    assert list(iter_events(['data: {"x": 1}'])) == ['{"x": 1}']


def test_sse_decoder_is_incremental():
    d = SSEDecoder()
    assert d.feed("data: a") is None
    assert d.feed("") == "a"
    assert d.flush() is None


# --- request building ------------------------------------------------------------------------------
def test_sampling_parameters_only_carry_what_was_set():
    req = GenerateRequest("hi", max_tokens=8, temperature=0.0, stop="END", ignore_eos=True, extra={"min_tokens": 2})
    assert sampling_parameters(req) == {"max_tokens": 8, "temperature": 0.0, "stop": ["END"],
                                        "ignore_eos": True, "min_tokens": 2}


def test_tensors_follow_the_vllm_backend_convention():
    t = tensors(GenerateRequest("héllo", max_tokens=4, input_ids=[1, 2, 3], return_logprobs=True))
    assert t["text_input"][1] == "BYTES" and t["text_input"][0].tolist() == ["héllo".encode()]
    assert t["input_ids"][0].dtype == np.int64 and t["input_ids"][0].shape == (3,)
    assert t["stream"][0].tolist() == [True] and t["exclude_input_in_output"][0].tolist() == [True]
    assert json.loads(t["sampling_parameters"][0][0]) == {"max_tokens": 4}
    assert {"return_finish_reason", "return_num_input_tokens", "return_num_output_tokens", "return_logprobs"} <= set(t)


def test_return_stats_off_sends_only_the_core_inputs():
    assert set(tensors(GenerateRequest("x", return_stats=False))) == {
        "text_input", "stream", "sampling_parameters", "exclude_input_in_output"}


def test_http_body_is_flat_json():
    body = http_body(GenerateRequest("hi", max_tokens=2, stream=False, input_ids=[5]))
    assert body["text_input"] == "hi" and body["stream"] is False and body["input_ids"] == [5]
    assert json.loads(body["sampling_parameters"]) == {"max_tokens": 2}
    json.dumps(body)  # serialisable as is


@pytest.mark.parametrize("kwargs", [{"max_tokens": 0}, {"max_tokens": 1.5}, {"temperature": -1}, {"top_p": 0}])
def test_bad_request_fields_raise_value_error(kwargs):
    with pytest.raises(ValueError):
        GenerateRequest("x", **kwargs)


def test_urls_are_normalised():
    assert grpc_target(None) == "localhost:8001" and grpc_target("grpc://h:1/") == "h:1"
    assert http_base(None) == "http://localhost:8000" and http_base("https://h:2/") == "https://h:2"


# --- responses -------------------------------------------------------------------------------------
def test_chunk_from_json_reads_all_outputs():
    c = chunk_from_json('{"text_output": " Paris", "finish_reason": "stop", "num_output_tokens": 1, '
                        '"num_input_tokens": 5, "output_ids": [42], "logprobs": "[{\\"42\\": -0.1}]"}')
    assert (c.text, c.finish_reason, c.num_output_tokens, c.num_input_tokens) == (" Paris", "stop", 1, 5)
    assert c.output_ids == [42] and c.logprobs == [{"42": -0.1}] and c.final


def test_chunk_from_json_error_event_raises():
    with pytest.raises(TandemError, match="boom"):
        chunk_from_json('{"error": "boom"}')


def test_chunk_from_grpc_reads_tensors_and_final_flag():
    from tritonclient.grpc import InferResult, service_pb2

    resp = service_pb2.ModelInferResponse(model_name="llm")
    for name, dtype, arr in [("text_output", "BYTES", np.array([b" hi"], dtype=np.object_)),
                             ("num_output_tokens", "INT32", np.array([1], dtype=np.int32))]:
        out = resp.outputs.add(name=name, datatype=dtype, shape=[1])
        raw = (len(arr[0]).to_bytes(4, "little") + arr[0]) if dtype == "BYTES" else arr.tobytes()
        resp.raw_output_contents.append(raw)
    resp.parameters["triton_final_response"].bool_param = True
    c = chunk_from_grpc(InferResult(resp))
    assert (c.text, c.num_output_tokens, c.final, c.finish_reason) == (" hi", 1, True, None)


def test_chunk_token_count_falls_back_to_ids_then_text():
    assert Chunk(text="a", num_output_tokens=3).tokens() == 3
    assert Chunk(text="a", output_ids=[1, 2]).tokens() == 2
    assert Chunk(text="a").tokens() == 1 and Chunk(text="").tokens() == 0


# --- errors ----------------------------------------------------------------------------------------
def test_http_errors_map_to_triton_status():
    err = from_http(400, '{"error": "max_tokens must be positive"}')
    assert (err.status, err.http_status, err.message) == ("INVALID_ARG", 400, "max_tokens must be positive")
    assert from_http(400, 'data: {"error": "bad"}\n\n').message == "bad"  # /generate_stream's error body
    assert from_http(503, "").status == "UNAVAILABLE"
    assert error_message_from_body("plain text") == "plain text"


def test_grpc_errors_map_and_unavailable_means_unreachable():
    from tritonclient.utils import InferenceServerException

    err = from_grpc(InferenceServerException("nope", status="StatusCode.INVALID_ARGUMENT"), "h:1")
    assert (err.status, err.message) == ("INVALID_ARGUMENT", "nope")
    down = from_grpc(InferenceServerException("refused", status="StatusCode.UNAVAILABLE"), "h:1")
    assert isinstance(down, TandemConnectionError) and down.url == "h:1"
    assert from_grpc(InferenceServerException("model said no"), "h:1").status is None  # stream errors: no code


# --- timing ----------------------------------------------------------------------------------------
def test_collector_times_first_token_and_end_with_a_fake_clock():
    now = iter([0.0, 0.1, 0.15, 0.2, 0.25])
    col = Collector(clock=lambda: next(now))
    col.add(Chunk(text="", num_output_tokens=0))  # an empty header response is not the first token
    col.add(Chunk(text="a", num_output_tokens=1))
    col.add(Chunk(text="b", num_output_tokens=1))
    col.add(Chunk(text="", num_output_tokens=1, finish_reason="length", final=True))
    r = col.result()
    assert r.text == "ab" and r.num_output_tokens == 3 and r.finish_reason == "length"
    assert r.ttft_s == pytest.approx(0.15) and r.e2e_s == pytest.approx(0.25)
    assert r.itl_s == pytest.approx(0.05)


def test_itl_undefined_for_one_response():
    assert Result(num_output_tokens=8, responses=1, ttft_s=0.1, e2e_s=0.1).itl_s is None


def test_locust_entries_from_a_result():
    r = Result(num_output_tokens=5, responses=5, ttft_s=0.01, e2e_s=0.05)
    got = {e.name: (round(e.response_time_ms, 3), e.response_length) for e in entries(r)}
    assert got == {"ttft": (10.0, 0), "itl": (10.0, 0), "e2e": (50.0, 5)}


# --- report ----------------------------------------------------------------------------------------
def _samples(n=10):
    return [{"start": 100.0 + i, "ttft_ms": 10.0 + i, "itl_ms": 2.0, "e2e_ms": 1000.0, "output_tokens": 16}
            for i in range(n)]


def test_summary_from_samples_is_exact():
    s = from_samples(_samples())
    assert s["requests"] == 10 and s["window_s"] == pytest.approx(10.0)
    assert s["output_tokens_per_s"] == pytest.approx(16.0) and s["ttft_ms"]["p50"] == pytest.approx(14.5)


def test_slos_pass_fail_and_missing():
    summary = {"ttft_ms": {"p95": 50.0}, "itl_ms": None}
    slos = check_slos(summary, 40.0, 10.0)
    assert slos["ttft_p95_ms"]["passed"] is False and slos["itl_p95_ms"]["passed"] is False
    assert check_slos(summary, 60.0, None) == {"ttft_p95_ms": {"target": 60.0, "measured": 50.0, "passed": True}}


def test_summarize_reads_locust_csvs_and_samples(tmp_path):
    header = ("Type,Name,Request Count,Failure Count,Median Response Time,Average Response Time,Min Response Time,"
              "Max Response Time,Average Content Size,Requests/s,Failures/s,50%,66%,75%,80%,90%,95%,98%,99%,"
              "99.9%,99.99%,100%")
    rows = ["grpc,e2e,10,1,1000,1000,900,1100,16,2.0,0.2,1000,1000,1000,1000,1000,1100,1100,1100,1100,1100,1100",
            "grpc,ttft,9,0,12,12,10,20,0,1.8,0,12,12,12,12,15,16,18,20,20,20,20",
            ",Aggregated,19,1,12,12,10,1100,8,3.8,0.2,12,12,12,12,15,16,18,20,20,20,20"]
    (tmp_path / "locust_stats.csv").write_text("\n".join([header, *rows]) + "\n")
    (tmp_path / "locust_failures.csv").write_text("Method,Name,Error,Occurrences\ngrpc,e2e,INVALID_ARG: x,1\n")
    samples = tmp_path / "samples.jsonl"
    samples.write_text("\n".join(json.dumps(s) for s in _samples()) + "\n")
    summary = summarize(tmp_path / "locust", samples, {"users": 1}, slo_ttft=100.0)
    assert summary["source"] == "samples" and summary["failures"] == {"count": 1, "messages": {"INVALID_ARG: x": 1}}
    assert summary["passed"] is False and "failure x1" in table(summary)
    fallback = from_locust_csv([dict(zip(header.split(","), r.split(","))) for r in rows])
    assert fallback["requests"] == 9 and fallback["ttft_ms"]["p95"] == 16.0 and fallback["itl_ms"] is None


# --- chat and CLI ----------------------------------------------------------------------------------
def test_chat_template_from_a_folder_and_the_fallback(tmp_path):
    from tandem_client.chat import ChatTemplate, load_template

    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
                          "{% if add_generation_prompt %}[assistant]{% endif %}", "bos_token": "<s>"}))
    template, note = load_template(tmp_path)
    assert note is None and template.render("hi", "sys") == "<s>[system]sys[user]hi[assistant]"
    assert ChatTemplate.fallback().render("hi") == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    _, note = load_template(tmp_path / "missing")
    assert "ChatML" in note


def test_cli_without_a_server_says_how_to_start_one():
    proc = subprocess.run([sys.executable, "-m", "tandem_client", "hi", "--url", "localhost:1"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3
    assert "cannot reach Triton over gRPC at localhost:1" in proc.stderr and "make serve" in proc.stderr


def test_cli_rejects_bad_sampling_values_before_connecting():
    proc = subprocess.run([sys.executable, "-m", "tandem_client", "hi", "--max-tokens", "0", "--url", "localhost:1"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "max_tokens" in proc.stderr


def test_failures_come_from_samples_when_present(tmp_path):
    samples = tmp_path / "samples.jsonl"
    rows = _samples(3) + [{"start": 1.0, "protocol": "grpc", "error": "INVALID_ARG: bad", "e2e_ms": 3.0}] * 2
    samples.write_text("\n".join(json.dumps(s) for s in rows) + "\n")
    summary = summarize(tmp_path / "locust", samples, {})  # no Locust CSVs at all
    assert summary["requests"] == 3 and summary["failures"] == {"count": 2, "messages": {"INVALID_ARG: bad": 2}}
    assert summary["passed"] is False


def test_locustfile_refuses_bad_settings_up_front():
    # a subprocess: importing locust here would gevent-patch the test process
    proc = subprocess.run([sys.executable, "-m", "locust", "-f", "loadtest/locustfile.py", "--headless", "-u", "1",
                           "-t", "30s", "--host", "localhost:1", "--temperature", "-1"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "temperature must be >= 0" in proc.stderr


def test_server_watch_summary_counts_deltas_and_gauge_statistics():
    from loadtest.server_watch import ServerWatch

    watch = ServerWatch("http://127.0.0.1:9/metrics", "llm")
    assert watch.summary() == {"error": "fewer than two samples of the metrics endpoint"}
    watch.samples = [
        {"tandem_generation_tokens_total": 100.0, "tandem_preemptions_total": 1.0, "tandem_num_requests_running": 0.0},
        {"tandem_generation_tokens_total": 150.0, "tandem_num_requests_running": 4.0, "tandem_gpu_busy_ratio": 0.5},
        {"tandem_generation_tokens_total": 220.0, "tandem_num_requests_running": 2.0, "tandem_gpu_busy_ratio": 0.7},
        {"tandem_generation_tokens_total": 260.0, "tandem_preemptions_total": 3.0, "tandem_num_requests_running": 0.0},
    ]
    assert watch.summary() == {"samples": 4, "generated_tokens": 160.0, "preemptions": 2.0,
                               "gpu_busy_ratio": {"mean": 0.6, "max": 0.7},
                               "running": {"mean": 3.0, "max": 4.0}}
    watch.samples, watch.errors = [{}], []
    watch._scrape()  # nothing listens on port 9: the error is kept, the watch goes on
    assert watch.errors and watch.summary()["error"].startswith("URLError")


def test_server_watch_end_point_waits_for_the_token_counter_to_settle():
    """stop() keeps scraping while the token counter still moves (the server flushes its counters on a timer), so
    tokens of the last responses count; it ends at the first unchanged pair, or at settle_s."""
    from loadtest.server_watch import GENERATED, ServerWatch

    watch = ServerWatch("http://127.0.0.1:9/metrics", "llm")
    values = iter([100.0, 260.0, 266.0, 268.0, 268.0, 999.0])
    watch.metrics.scrape = lambda: [(GENERATED, {}, next(values))]
    watch.start()  # 100: the starting point
    summary = watch.stop(settle_s=5.0, poll_s=0.01)
    assert summary["generated_tokens"] == 168.0 and summary["samples"] == 5
    stuck = ServerWatch("http://127.0.0.1:9/metrics", "llm")
    counter = iter(range(1000))
    stuck.metrics.scrape = lambda: [(GENERATED, {}, float(next(counter)))]
    stuck.start()
    started = time.monotonic()
    stuck.stop(settle_s=0.2, poll_s=0.01)  # a counter that never settles: bounded by settle_s
    assert time.monotonic() - started < 2.0


def test_server_watch_averages_ratios_and_adds_counts_over_instances():
    from loadtest.server_watch import combine

    kv, running, done = "tandem_kv_cache_usage_ratio", "tandem_num_requests_running", "tandem_requests_total"
    samples = [(kv, {"instance": "a"}, 0.25), (kv, {"instance": "b"}, 0.75),
               (running, {"instance": "a"}, 3.0), (running, {"instance": "b"}, 5.0),
               (done, {"finish_reason": "stop"}, 2.0), (done, {"finish_reason": "length"}, 7.0)]
    assert combine(samples) == {kv: 0.5, running: 8.0, done: 9.0}
