"""The Tandem model served by a real tritonserver: gRPC streams, HTTP generate/SSE, flags, errors, cancel, unload."""
from __future__ import annotations

import json
import queue
import re
import time
import urllib.request
from dataclasses import dataclass, field

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from backend import Engine, EngineConfig, SamplingParams

pytestmark = pytest.mark.integration

PROMPTS = [
    "The capital of France is", "Write a haiku about GPUs.", "1, 2, 3, 4,", "Once upon a time",
    "def fibonacci(n):", "The best way to learn", "Water boils at", "My favourite colour is",
]
MAX_TOKENS = 8
GREEDY = {"max_tokens": MAX_TOKENS, "temperature": 0}


@dataclass(slots=True)
class Ref:
    """The engine's own offline greedy output for one prompt."""

    text: str
    token_ids: list[int]
    prompt_ids: list[int]
    finish_reason: str


@pytest.fixture(scope="module")
def reference() -> dict[str, Ref]:
    engine = Engine(EngineConfig(device="cpu", num_kv_blocks=128, max_num_seqs=8, max_model_len=1024))
    try:
        outs = engine.generate(PROMPTS, SamplingParams(**GREEDY))
        prompt_ids = [list(engine.tokenizer.encode(p)) for p in PROMPTS]
    finally:
        engine.shutdown()
    return {p: Ref(o.text, list(o.token_ids), ids, o.finish_reason) for p, o, ids in zip(PROMPTS, outs, prompt_ids)}


# ---- gRPC helpers ----------------------------------------------------------------------------------
@dataclass(slots=True)
class Collected:
    """Everything one request received on a gRPC stream."""

    responses: list = field(default_factory=list)
    errors: list = field(default_factory=list)
    finals: int = 0

    def text(self) -> str:
        return "".join(r.as_numpy("text_output")[0].decode() for r in self.responses)

    def output(self, name: str) -> list:
        return [x for r in self.responses if r.as_numpy(name) is not None for x in r.as_numpy(name).tolist()]


def grpc_inputs(prompt: str | None = None, ids: list[int] | None = None, stream: bool = True,
                sampling: dict | None = None, **flags: bool) -> list:
    def tensor(name, array, dtype):
        t = grpcclient.InferInput(name, list(array.shape), dtype)
        t.set_data_from_numpy(array)
        return t

    inputs = []
    if prompt is not None:
        inputs.append(tensor("text_input", np.array([prompt.encode()], dtype=np.object_), "BYTES"))
    if ids is not None:
        inputs.append(tensor("input_ids", np.array(ids, dtype=np.int64), "INT64"))
    inputs.append(tensor("stream", np.array([stream]), "BOOL"))
    if sampling is not None:
        inputs.append(tensor("sampling_parameters", np.array([json.dumps(sampling).encode()], dtype=np.object_),
                             "BYTES"))
    for name, value in flags.items():
        inputs.append(tensor(name, np.array([value]), "BOOL"))
    return inputs


class GrpcStream:
    """One tritonclient gRPC stream; responses are sorted per request id."""

    def __init__(self, server):
        self.server = server
        self.client = grpcclient.InferenceServerClient(server.grpc_url)
        self.events: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.events.put((result, error)))
        self.results: dict[str, Collected] = {}

    def send(self, request_id: str, inputs: list) -> None:
        self.results[request_id] = Collected()
        self.client.async_stream_infer(self.server.model_name, inputs, request_id=request_id,
                                       enable_empty_final_response=True)

    def next_event(self, timeout: float) -> None:
        result, error = self.events.get(timeout=timeout)
        if error is not None:
            # An error is always the request's final answer; with one request per stream it is unambiguous.
            target = next((c for c in self.results.values() if not c.finals), None)
            assert target is not None, f"error for no pending request: {error}"
            target.errors.append(error)
            target.finals += 1
            return
        response = result.get_response()
        collected = self.results[response.id]
        if result.as_numpy("text_output") is not None:
            collected.responses.append(result)
        if response.parameters["triton_final_response"].bool_param:
            collected.finals += 1

    def wait_all(self, timeout: float = 120.0) -> dict[str, Collected]:
        deadline = time.monotonic() + timeout
        while any(c.finals == 0 for c in self.results.values()):
            self.next_event(max(0.1, deadline - time.monotonic()))
        time.sleep(0.2)  # nothing may follow a final response
        while not self.events.empty():
            self.next_event(1)
        return self.results

    def close(self, cancel: bool = False) -> None:
        if self.client is not None:
            self.client.stop_stream(cancel_requests=cancel)
            self.client.close()
            self.client = None


def scrape(server, name: str) -> float:
    """Sum of a Prometheus metric's samples for this model."""
    text = urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()
    pattern = re.compile(rf'^{re.escape(name)}\{{[^}}]*model="{server.model_name}"[^}}]*\}} ([0-9.eE+-]+)$', re.M)
    return sum(float(v) for v in pattern.findall(text))


def scrape_finished(server, reason: str, default: float = 0.0) -> float:
    """tandem_requests_total for one finish reason."""
    text = urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()
    m = re.search(rf'^tandem_requests_total\{{[^}}]*finish_reason="{reason}"[^}}]*\}} ([0-9.eE+-]+)$', text, re.M)
    return float(m.group(1)) if m else default


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def http_generate(server, body: dict, stream: bool = False) -> requests.Response:
    path = "generate_stream" if stream else "generate"
    url = f"http://{server.http_url}/v2/models/{server.model_name}/{path}"
    return requests.post(url, json=body, stream=stream, timeout=120)


def sse_events(response: requests.Response) -> list[dict]:
    return [json.loads(line[5:]) for line in response.iter_lines(decode_unicode=True) if line.startswith("data:")]


# ---- tests ---------------------------------------------------------------------------------------
def test_grpc_streaming_matches_offline(triton_server, reference):
    stream = GrpcStream(triton_server)
    try:
        for i, prompt in enumerate(PROMPTS[:3]):
            stream.send(f"s{i}", grpc_inputs(prompt, sampling=GREEDY, return_finish_reason=True,
                                             return_num_output_tokens=True, return_num_input_tokens=True))
        results = stream.wait_all()
    finally:
        stream.close()
    for i, prompt in enumerate(PROMPTS[:3]):
        got, ref = results[f"s{i}"], reference[prompt]
        assert not got.errors and got.finals == 1
        assert got.text() == ref.text  # the deltas concatenate to the offline text
        assert sum(got.output("num_output_tokens")) == len(ref.token_ids)
        assert got.output("num_input_tokens")[-1] == len(ref.prompt_ids)
        reasons = [r.decode() for r in got.output("finish_reason")]
        assert reasons[-1] == ref.finish_reason and all(r == "None" for r in reasons[:-1])  # vLLM's str(None)


def test_grpc_input_ids_return_output_ids(triton_server, reference):
    prompt = PROMPTS[0]
    stream = GrpcStream(triton_server)
    try:
        stream.send("ids", grpc_inputs(ids=reference[prompt].prompt_ids, stream=False, sampling=GREEDY,
                                       exclude_input_in_output=True))
        got = stream.wait_all()["ids"]
    finally:
        stream.close()
    assert not got.errors and len(got.responses) == 1  # non-streaming: exactly one response
    assert got.output("output_ids") == reference[prompt].token_ids
    assert got.text() == reference[prompt].text


def test_http_generate_flags_and_prompt_prefix(triton_server, reference):
    prompt, ref = PROMPTS[1], reference[PROMPTS[1]]
    flags = {"return_finish_reason": True, "return_num_input_tokens": True, "return_num_output_tokens": True,
             "return_logprobs": True}
    excluded = http_generate(triton_server, {"text_input": prompt, "exclude_input_in_output": True,
                                             "parameters": {**GREEDY, "logprobs": 0}, **flags})
    assert excluded.status_code == 200, excluded.text
    body = excluded.json()
    assert body["text_output"] == ref.text
    assert body["finish_reason"] == ref.finish_reason
    assert body["num_input_tokens"] == len(ref.prompt_ids)
    assert body["num_output_tokens"] == len(ref.token_ids)
    logprobs = json.loads(body["logprobs"])  # vLLM's format: per token {id: {logprob, rank, decoded_token}}
    assert [list(entry) for entry in logprobs] == [[str(t)] for t in ref.token_ids]
    assert all(e[str(t)]["rank"] == 1 and e[str(t)]["logprob"] <= 0 for e, t in zip(logprobs, ref.token_ids))
    shown = [e[str(t)]["decoded_token"] for e, t in zip(logprobs, ref.token_ids)]
    if ref.finish_reason == "stop":
        shown = shown[:-1]  # the stop token has a decoded_token, but no text in text_output
    assert "".join(shown) == ref.text
    unasked = http_generate(triton_server, {"text_input": prompt, "parameters": GREEDY, **flags})
    assert json.loads(unasked.json()["logprobs"]) is None  # no logprobs in the sampling parameters: null, as vLLM
    # vLLM-backend default for a non-streaming request: the prompt comes first; no extra outputs unless asked.
    default = http_generate(triton_server, {"text_input": prompt, "parameters": GREEDY})
    assert default.status_code == 200, default.text
    assert default.json()["text_output"] == prompt + ref.text
    assert not {"finish_reason", "num_input_tokens", "num_output_tokens", "logprobs"} & set(default.json())
    # sampling values may also come as the sampling_parameters tensor, numbers as strings (vLLM clients do)
    as_tensor = http_generate(triton_server, {"text_input": prompt, "exclude_input_in_output": True,
                                              "sampling_parameters": json.dumps({"max_tokens": str(MAX_TOKENS),
                                                                                 "temperature": "0"})})
    assert as_tensor.status_code == 200 and as_tensor.json()["text_output"] == ref.text


def test_http_generate_stream_sse(triton_server, reference):
    prompt, ref = PROMPTS[2], reference[PROMPTS[2]]
    response = http_generate(triton_server, {"text_input": prompt, "stream": True, "return_finish_reason": True,
                                             "parameters": GREEDY}, stream=True)
    assert response.status_code == 200
    events = sse_events(response)
    assert len(events) >= 2 and all("error" not in e for e in events)
    assert "".join(e["text_output"] for e in events) == ref.text
    assert events[-1]["finish_reason"] == ref.finish_reason


def run_on_streams(server, requests: dict, num_streams: int = 4, timeout: float = 150) -> dict:
    """Send {request_id: inputs} spread over a few gRPC streams at once; every request's collected responses."""
    streams = [GrpcStream(server) for _ in range(num_streams)]
    try:
        for i, (rid, inputs) in enumerate(requests.items()):
            streams[i % num_streams].send(rid, inputs)
        results = {}
        for s in streams:
            results.update(s.wait_all(timeout=timeout))
    finally:
        for s in streams:
            s.close()
    return results


def test_64_concurrent_streams(triton_server, reference):
    # 4 gRPC streams x 16 requests
    results = run_on_streams(triton_server, {f"c{i}": grpc_inputs(PROMPTS[i % len(PROMPTS)], sampling=GREEDY)
                                             for i in range(64)})
    assert len(results) == 64
    wrong = [rid for rid, got in results.items()
             if got.errors or got.finals != 1 or got.text() != reference[PROMPTS[int(rid[1:]) % len(PROMPTS)]].text]
    assert not wrong, f"requests with errors or wrong text: {wrong}"


def latency_series(server) -> dict[str, dict[str, float]]:
    """For each latency histogram: its _count, _sum and cumulative _bucket values by `le`, for this model."""
    from loadtest.server_metrics import ServerMetrics

    out: dict[str, dict[str, float]] = {}
    for name, labels, value in ServerMetrics(server.metrics_url, server.model_name).scrape():
        for base in ("tandem_time_to_first_token_seconds", "tandem_inter_token_latency_seconds",
                     "tandem_request_latency_seconds"):
            if name.startswith(base + "_"):
                key = labels["le"] if name.endswith("_bucket") else name[len(base) + 1:]
                out.setdefault(base, {})
                out[base][key] = out[base].get(key, 0.0) + value
    return out


def test_latency_histograms_count_every_request_and_token(triton_server):
    """TTFT and end-to-end: one observation per request; inter-token latency: one per token after the first;
    buckets cumulative up to +Inf = _count. Counted in the stub, flushed to Triton every 0.1 s."""
    before = latency_series(triton_server)
    generated_before = scrape(triton_server, "tandem_generation_tokens_total")
    sampling = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
    # 8 streaming requests and 4 that want the final response only (their tokens all reach the adapter at the end)
    requests = {f"h{i}": grpc_inputs(PROMPTS[i % len(PROMPTS)], sampling=sampling) for i in range(8)}
    requests.update({f"f{i}": grpc_inputs(PROMPTS[i % len(PROMPTS)], stream=False, sampling=sampling)
                     for i in range(4)})
    results = run_on_streams(triton_server, requests)
    assert all(not r.errors and r.finals == 1 for r in results.values())
    assert all(len(results[f"f{i}"].responses) == 1 for i in range(4))

    def delta(base: str, key: str) -> float:
        return latency_series(triton_server).get(base, {}).get(key, 0.0) - before.get(base, {}).get(key, 0.0)

    wait_for(lambda: delta("tandem_request_latency_seconds", "count") >= 12, 10, "the metrics flush")
    time.sleep(0.3)  # any later flush would show up now
    after = latency_series(triton_server)
    expected = {"tandem_time_to_first_token_seconds": 12, "tandem_inter_token_latency_seconds": 12 * 11,
                "tandem_request_latency_seconds": 12}
    for base, count in expected.items():
        got = {k: v - before.get(base, {}).get(k, 0.0) for k, v in after[base].items()}
        assert got["count"] == count, (base, got)
        assert got["+Inf"] == count and got["sum"] >= 0
        bounds = sorted((float(k), v) for k, v in got.items() if k not in ("count", "sum", "+Inf"))
        assert [v for _, v in bounds] == sorted(v for _, v in bounds), f"{base}: buckets must be cumulative"
    assert scrape(triton_server, "tandem_generation_tokens_total") - generated_before == 144


def test_cancelled_stream_frees_kv_blocks(triton_server):
    aborts = scrape_finished(triton_server, "abort")
    stream = GrpcStream(triton_server)
    try:
        # ignore_eos: the request must still be running when it is cancelled
        stream.send("long", grpc_inputs("Tell me a very long story about a dragon.",
                                        sampling={"max_tokens": 900, "temperature": 0, "ignore_eos": True}))
        stream.next_event(timeout=60)  # the first token: the request holds KV blocks now
        assert not stream.results["long"].errors, stream.results["long"].errors
        wait_for(lambda: scrape(triton_server, "tandem_kv_cache_blocks_used") > 0, 10, "KV blocks in use")
    finally:
        stream.close(cancel=True)  # an open stream would also hold up the model's unload
    wait_for(lambda: scrape(triton_server, "tandem_kv_cache_blocks_used") == 0
             and scrape(triton_server, "tandem_num_requests_running") == 0, 20, "KV blocks freed after cancel")
    assert scrape(triton_server, "tandem_kv_cache_usage_ratio") == 0
    wait_for(lambda: scrape_finished(triton_server, "abort") == aborts + 1, 10, "the request to end as aborted")

@pytest.mark.parametrize("body, field", [
    ({"stream": False, "parameters": {"max_tokens": 2}}, "text_input"),  # no prompt at all
    ({"text_input": "Hi", "parameters": {"max_tokenz": 4}}, "max_tokenz"),  # unknown sampling key
    ({"text_input": "Hi", "parameters": {"temperature": -1}}, "temperature"),
    ({"text_input": "Hi", "parameters": {"max_tokens": 0}}, "max_tokens"),
    ({"text_input": "Hi", "sampling_parameters": "{\"max_tokens\": 4"}, "sampling_parameters"),  # malformed JSON
    ({"text_input": "Hi", "stream": True, "exclude_input_in_output": False}, "exclude_input_in_output"),
])
def test_bad_http_request_is_invalid_arg(triton_server, body, field):
    response = http_generate(triton_server, body)
    assert response.status_code == 400, response.text
    assert field in response.json()["error"]
    good = http_generate(triton_server, {"text_input": "Hi", "parameters": {"max_tokens": 2}})
    assert good.status_code == 200, good.text


def test_bad_grpc_request_is_invalid_arg(triton_server):
    stream = GrpcStream(triton_server)
    try:
        stream.send("bad", grpc_inputs("Hi", sampling={"temperature": -1, "max_tokens": 4}))
        bad = stream.wait_all()["bad"]
        stream.send("good", grpc_inputs("Hi", sampling={"max_tokens": 2}))
        good = stream.wait_all()["good"]
    finally:
        stream.close()
    assert len(bad.errors) == 1 and not bad.responses
    assert isinstance(bad.errors[0], InferenceServerException)
    # A stream error carries only its message (the status code reaches HTTP callers as 400, tested above).
    assert "temperature" in bad.errors[0].message() and "[0.0, 100.0]" in bad.errors[0].message()
    assert not good.errors and good.finals == 1 and good.text()


def test_unload_answers_streams_in_flight(triton_server):
    """Runs last in this file: unloads the model, checks the stub is gone, then loads it back."""
    client = grpcclient.InferenceServerClient(triton_server.grpc_url)
    stream = GrpcStream(triton_server)
    try:
        for i in range(3):
            stream.send(f"u{i}", grpc_inputs(PROMPTS[i], sampling={"max_tokens": 24, "ignore_eos": True}))
        stream.next_event(timeout=60)  # streams are producing tokens
        client.unload_model(triton_server.model_name)
        results = stream.wait_all(timeout=120)
        assert all(c.finals == 1 for c in results.values())  # every stream got its one final answer
        stream.close()  # Triton finishes an unload only once the client's gRPC streams are closed
        wait_for(lambda: not client.is_model_ready(triton_server.model_name) and not triton_server.stub_pids(),
                 60, "the model to unload and its stub process to exit")
    finally:
        stream.close()  # idempotent
        client.load_model(triton_server.model_name)
        wait_for(lambda: client.is_model_ready(triton_server.model_name), 180, "the model to load again")
        client.close()
    good = http_generate(triton_server, {"text_input": "Hi", "parameters": {"max_tokens": 2}})
    assert good.status_code == 200, good.text
