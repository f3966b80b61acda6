"""The vLLM backend's request and response conventions, against the real tritonserver.

The first tests send exactly what Triton's OpenAI-compatible frontend (server repo, python/openai, `--backend vllm`)
builds for a chat and a completions request: its converter dumps the OpenAI request (unset fields dropped) into
`sampling_parameters`, sets `exclude_input_in_output` and asks for `num_input_tokens` / `num_output_tokens`, which
it reads as UINT32 only. Its in-process `tritonserver` package does not install here, so these requests are built
from its published converter rather than by running it.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from tests.integration.conftest import CPU_PARAMETERS, close_server, launch_server
from tests.integration.test_triton_serving import GrpcStream, grpc_inputs, http_generate, scrape, wait_for

pytestmark = pytest.mark.integration

GREEDY = {"max_tokens": 8, "temperature": 0}
# what the frontend's converter sends for a chat request with temperature 0, max_tokens 8, seed 7 and a stop
CHAT = {"frequency_penalty": 0.0, "logprobs": False, "n": 1, "presence_penalty": 0.0, "seed": 7, "stop": ["###"],
        "temperature": 0.0, "top_p": 1.0, "max_tokens": 8}
# ... and for a completions request (its schema defaults best_of and n to 1; echo becomes exclude_input_in_output)
COMPLETION = {"best_of": 1, "frequency_penalty": 0.0, "n": 1, "presence_penalty": 0.0, "seed": 7,
              "temperature": 0.0, "top_p": 1.0, "max_tokens": 8}
FRONTEND_FLAGS = {"exclude_input_in_output": True, "return_num_input_tokens": True, "return_num_output_tokens": True}


def ask(server, prompt: str, sampling: dict, stream: bool, **flags: bool):
    """One request on its own gRPC stream; returns its Collected answer."""
    grpc = GrpcStream(server)
    try:
        grpc.send("r", grpc_inputs(prompt, stream=stream, sampling=sampling, **flags))
        return grpc.wait_all()["r"]
    finally:
        grpc.close()


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "streaming"])
@pytest.mark.parametrize("sampling", [CHAT, COMPLETION], ids=["chat", "completions"])
def test_openai_frontend_requests_are_answered_with_uint32_usage(triton_server, sampling, stream):
    """The frontend's requests give the text the plain greedy request gives, and usage the frontend can read."""
    prompt = "The capital of France is"
    want = ask(triton_server, prompt, GREEDY, stream=False, exclude_input_in_output=True, return_num_input_tokens=True)
    got = ask(triton_server, prompt, sampling, stream=stream, **FRONTEND_FLAGS)
    assert not got.errors and got.finals == 1, got.errors
    assert got.text() == want.text()
    for name in ("num_input_tokens", "num_output_tokens"):
        assert {r.as_numpy(name).dtype for r in got.responses} == {np.dtype(np.uint32)}, name
    outputs = got.output("num_output_tokens")  # one per response: the tokens it carries (a delta when streaming)
    assert sum(outputs) == 8 and (len(outputs) > 1) == stream
    prompt_tokens = want.output("num_input_tokens")
    assert prompt_tokens[0] > 0 and set(got.output("num_input_tokens")) == set(prompt_tokens)


def test_chat_logprobs_true_with_top_logprobs(triton_server):
    """OpenAI chat's logprobs: true + top_logprobs: k asks for the sampled token's logprob and k alternatives,
    returned in vLLM's format, which the OpenAI frontend parses: per token, {token id: {logprob, rank,
    decoded_token}}, the sampled (greedy: rank 1) token among them."""
    got = ask(triton_server, "Hello", {**CHAT, "logprobs": True, "top_logprobs": 2}, stream=False,
              return_logprobs=True, return_output_ids=True)
    assert not got.errors, got.errors
    entries = json.loads(got.responses[-1].as_numpy("logprobs")[0])
    ids = got.output("output_ids")
    assert len(entries) == len(ids) == 8
    for entry, token in zip(entries, ids):
        assert len(entry) == 2 and sorted(e["rank"] for e in entry.values()) == [1, 2]
        assert entry[str(token)]["rank"] == 1 and isinstance(entry[str(token)]["decoded_token"], str)
        assert entry[str(token)]["logprob"] >= max(e["logprob"] for e in entry.values())


# a chat turn the default model answers in a few tokens, then <|im_end|> (its end-of-sequence token)
CHAT_TURN = "<|im_start|>user\nWhat is the capital of France? Answer in one word.<|im_end|>\n<|im_start|>assistant\n"
IM_END = 2  # SmolLM2's <|im_end|>


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "streaming"])
@pytest.mark.parametrize("logprobs", [0, 2])
def test_logprobs_decoded_tokens_follow_the_texts_rule_for_special_tokens(triton_server, logprobs, stream):
    """A request that ends on <|im_end|>: its text skips special tokens (skip_special_tokens, the default), and so
    do the decoded tokens of logprobs ("" for <|im_end|>, as vLLM gives): the sampled tokens' decoded_token make up
    each response's text_output, as the vLLM backend's additional-outputs test checks. With skip_special_tokens
    false they keep their names."""
    sampling = {"max_tokens": 32, "temperature": 0, "logprobs": logprobs}
    flags = {"exclude_input_in_output": True, "return_logprobs": True, "return_output_ids": True,
             "return_finish_reason": True}
    got = ask(triton_server, CHAT_TURN, sampling, stream=stream, **flags)
    assert not got.errors and got.finals == 1, got.errors
    ids = got.output("output_ids")
    assert ids[-1] == IM_END and [r for r in got.output("finish_reason") if r != b"None"] == [b"stop"]
    assert got.text() == "The capital of France is Paris."
    for response in got.responses:
        entries = json.loads(response.as_numpy("logprobs")[0])
        tokens = response.as_numpy("output_ids").tolist()
        assert len(entries) == len(tokens)
        decoded = "".join(entry[str(token)]["decoded_token"] for entry, token in zip(entries, tokens))
        assert decoded == response.as_numpy("text_output")[0].decode()
        for entry in entries:
            assert len(entry) <= logprobs + 1
            if str(IM_END) in entry:  # sampled or an alternative
                assert entry[str(IM_END)]["decoded_token"] == ""
    kept = ask(triton_server, CHAT_TURN, {**sampling, "skip_special_tokens": False}, stream=stream, **flags)
    last = json.loads(kept.responses[-1].as_numpy("logprobs")[0])[-1]
    assert kept.output("output_ids") == ids and last[str(IM_END)]["decoded_token"] == "<|im_end|>"


def test_cumulative_logprob_is_the_sum_of_the_tokens_logprobs(triton_server):
    """return_cumulative_logprob: FP32 cumulative_logprob, the running sum over the output so far in every response
    of a stream; the last one equals the sum of the logprobs returned."""
    for stream in (False, True):
        got = ask(triton_server, "Once upon a time", {"max_tokens": 6, "temperature": 0.8, "seed": 3, "logprobs": 0},
                  stream=stream, return_cumulative_logprob=True, return_logprobs=True, return_output_ids=True)
        assert not got.errors, got.errors
        cumulative = [r.as_numpy("cumulative_logprob") for r in got.responses]
        assert all(c.dtype == np.float32 and c.shape == (1,) for c in cumulative)
        entries = [e for r in got.responses for e in json.loads(r.as_numpy("logprobs")[0])]
        ids = got.output("output_ids")
        assert len(entries) == len(ids) == 6
        logprobs = [entry[str(token)]["logprob"] for entry, token in zip(entries, ids)]
        assert all(entry[str(token)]["rank"] >= 1 for entry, token in zip(entries, ids))
        assert cumulative[-1][0] == pytest.approx(sum(logprobs), abs=1e-4)
        assert cumulative[-1][0] < 0
        values = [c[0] for c in cumulative]
        assert values == sorted(values, reverse=True)  # a running sum of negative numbers only falls


def test_string_booleans_mean_what_they_say(triton_server):
    """"ignore_eos": "false" is false (vLLM's own cast would make any non-empty string true)."""
    got = ask(triton_server, "Hi", {"max_tokens": 4, "temperature": 0, "ignore_eos": "false", "logprobs": "false",
                                    "detokenize": "true", "spaces_between_special_tokens": True, "seed": None},
              stream=False)
    assert not got.errors, got.errors


@pytest.mark.parametrize("extra, message", [
    ({"n": 65}, "n must be in [1, 64]"),
    ({"n": 1, "best_of": 2}, "best_of (2) must equal n (1)"),
    ({"lora_name": "adapter"}, "LoRA is not enabled"),
    ({"guided_decoding": json.dumps({"json": {"type": "object"}}), "structured_outputs": json.dumps({"regex": "a"})},
     "not both"),
    ({"structured_outputs": json.dumps({"regex": "[0-9]+", "choice": ["7"]})}, "not regex and choice together"),
    ({"logit_bias": {"dragon": 5.0}}, "logit_bias keys must be token ids"),
    ({"allowed_token_ids": [10**7]}, "allowed_token_ids: 10000000 is outside the vocabulary"),
    ({"bad_words": [""]}, "bad_words must be a string or a list of non-empty strings"),
    ({"prompt_logprobs": -2}, "prompt_logprobs must be -1 or more"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens must be >= 1"),
    ({"detokenize": False}, "detokenize: only true is supported"),
    ({"logprobs": -1}, "the whole vocabulary"),
    ({"n": "two"}, "n must be an integer"),
    ({"user": "someone"}, "unknown sampling parameter"),  # not a vLLM key: still an error
])
def test_keys_we_cannot_honour_are_invalid_arg_with_a_reason(triton_server, extra, message):
    response = http_generate(triton_server, {"text_input": "Hi", "sampling_parameters": json.dumps({**GREEDY, **extra})})
    assert response.status_code == 400, response.text
    assert message in response.json()["error"], response.json()


def _texts(response) -> list[str]:
    return [t.decode() for t in response.as_numpy("text_output")]


def test_n_samples_come_as_one_entry_each(triton_server):
    """n = 3 as the vLLM backend returns it: every output an array of 3, sample i what a lone request seeded
    seed + i gives; streamed, each response carries one sample's delta (the others empty) and one final closes all."""
    sampling = {"max_tokens": 6, "temperature": 0.9, "seed": 21, "ignore_eos": True}
    flags = dict(exclude_input_in_output=True, return_finish_reason=True, return_num_output_tokens=True,
                 return_cumulative_logprob=True)
    prompt = "Write a word:"
    singles = [ask(triton_server, prompt, {**sampling, "seed": 21 + i}, stream=False, **flags) for i in range(3)]
    want = [s.text() for s in singles]
    unary = ask(triton_server, prompt, {**sampling, "n": 3, "best_of": 3}, stream=False, **flags)
    assert not unary.errors and unary.finals == 1 and len(unary.responses) == 1, unary.errors
    final = unary.responses[0]
    assert _texts(final) == want
    assert [r.decode() for r in final.as_numpy("finish_reason")] == ["length"] * 3
    assert final.as_numpy("num_output_tokens").tolist() == [6, 6, 6]
    assert final.as_numpy("cumulative_logprob").shape == (3,)
    streamed = ask(triton_server, prompt, {**sampling, "n": 3}, stream=True, **flags)
    assert not streamed.errors and streamed.finals == 1, streamed.errors
    joined = ["", "", ""]
    counts = [0, 0, 0]
    for response in streamed.responses:
        texts = _texts(response)
        assert len(texts) == 3 and sum(bool(t) for t in texts) <= 1  # one sample's news per response
        joined = [a + b for a, b in zip(joined, texts)]
        counts = [a + b for a, b in zip(counts, response.as_numpy("num_output_tokens").tolist())]
    assert joined == want and counts == [6, 6, 6]
    last = [r.decode() for r in streamed.responses[-1].as_numpy("finish_reason")]
    assert last == ["length"] * 3


def test_logit_rules_and_truncation_change_what_is_generated(triton_server):
    """allowed_token_ids, logit_bias (string keys, as JSON and OpenAI send them), bad_words and
    truncate_prompt_tokens through the real server."""
    ids_flags = dict(return_output_ids=True, return_num_input_tokens=True, exclude_input_in_output=True)
    prompt = "List three colors:"
    free = ask(triton_server, prompt, GREEDY, stream=False, **ids_flags)
    free_ids = free.output("output_ids")
    allowed = ask(triton_server, prompt, {**GREEDY, "allowed_token_ids": [28, 29]}, stream=False, **ids_flags)
    assert set(allowed.output("output_ids")) <= {28, 29}
    biased = ask(triton_server, prompt, {**GREEDY, "logit_bias": {"31": 100}}, stream=False, **ids_flags)
    assert biased.output("output_ids") == [31] * 8
    word = free.text().split()[0]
    banned = ask(triton_server, prompt, {**GREEDY, "bad_words": [word]}, stream=False, **ids_flags)
    assert not banned.errors and banned.output("output_ids") != free_ids
    assert word not in banned.text().split()
    full = free.output("num_input_tokens")[0]
    cut = ask(triton_server, prompt, {**GREEDY, "truncate_prompt_tokens": 2, "prompt_logprobs": 1}, stream=False,
              **ids_flags)
    assert not cut.errors and full > 2 and cut.output("num_input_tokens") == [2]


def test_report_custom_metrics_adds_the_vllm_series(triton_server, tmp_path_factory):
    """REPORT_CUSTOM_METRICS "true": the vLLM backend's vllm:* series, fed by the same observations as ours; without
    it (the default server) there are none."""
    assert "vllm:" not in _metrics_text(triton_server)
    server = launch_server(tmp_path_factory.mktemp("vllm-metrics"), {**CPU_PARAMETERS, "REPORT_CUSTOM_METRICS": "true"})
    try:
        got = ask(server, "Hello there", {"max_tokens": 5, "temperature": 0, "ignore_eos": True}, stream=True,
                  return_num_input_tokens=True)
        assert not got.errors, got.errors
        prompt_tokens = got.output("num_input_tokens")[0]
        # request_params_n is the last series a flush sends: once it counts the request, the rest are in
        wait_for(lambda: scrape(server, "vllm:request_params_n_count") == 1, 10, "vllm:* flushed")
        assert scrape(server, "vllm:e2e_request_latency_seconds_count") == 1
        assert scrape(server, "vllm:generation_tokens_total") == 5
        assert scrape(server, "vllm:prompt_tokens_total") == prompt_tokens
        assert scrape(server, "vllm:time_to_first_token_seconds_count") == 1
        assert scrape(server, "vllm:time_per_output_token_seconds_count") == 4  # the tokens after the first
        assert scrape(server, "vllm:request_generation_tokens_sum") == 5
        assert scrape(server, "vllm:request_prompt_tokens_sum") == prompt_tokens
        text = _metrics_text(server)
        for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:gpu_cache_usage_perc"):
            assert f"{gauge}{{" in text, gauge
        assert scrape(server, "tandem_generation_tokens_total") == 5  # ours are still there
    finally:
        close_server(server)


def _metrics_text(server) -> str:
    import urllib.request

    return urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()
