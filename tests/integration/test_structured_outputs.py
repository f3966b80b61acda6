"""Structured outputs through the real tritonserver, with the default model on the CPU.

A request's `sampling_parameters` carries `structured_outputs` (or its older name `guided_decoding`): a JSON schema,
regex, choice list or Lark grammar. Checked here: sampled outputs (temperature 1.0) follow their constraint over gRPC
streaming and HTTP generate and end with finish reason "stop"; n = 3 gives three valid samples; a stop string cuts a
constrained output; the request the OpenAI frontend builds for a forced tool call (a named function and "required")
returns arguments that validate against the tool's schema; every bad constraint is a 400 whose message names the
fault, and the server keeps serving; bans that leave the grammar no token end that request with INVALID_ARG; a
cancelled constrained stream frees its resources. Schemas are bounded (enums, integer ranges, booleans) so that the
small model's outputs end well within max_tokens.
"""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest

from tests.integration.test_triton_serving import (
    GrpcStream, grpc_inputs, http_generate, scrape, scrape_finished, wait_for,
)
from tests.integration.test_robustness_input import error_counts, settled_error_counts
from tests.integration.test_vllm_conventions import CHAT, FRONTEND_FLAGS, ask
from tests.structured_cases import CHOICES, GRAMMAR, GRAMMAR_LANGUAGE, PROMPT, REGEX, TOOL_SCHEMA

pytestmark = pytest.mark.integration

# each constraint (as a structured_outputs object) and a check of one output text against it
CONSTRAINTS = {
    "json": ({"json": TOOL_SCHEMA, "disable_any_whitespace": True},
             lambda text: jsonschema.validate(json.loads(text), TOOL_SCHEMA)),
    "regex": ({"regex": REGEX}, lambda text: _assert(re.fullmatch(REGEX, text), text)),
    "choice": ({"choice": CHOICES}, lambda text: _assert(text in CHOICES, text)),
    "grammar": ({"grammar": GRAMMAR}, lambda text: _assert(re.fullmatch(GRAMMAR_LANGUAGE, text), text)),
}
SAMPLED = {"max_tokens": 80, "temperature": 1.0, "seed": 7}
FLAGS = {"exclude_input_in_output": True, "return_finish_reason": True}


def _assert(ok, text: str) -> None:
    assert ok, f"output does not follow the constraint: {text!r}"


def _finish_reasons(collected) -> list[bytes]:
    """The finish reasons a gRPC request reported (streams send "None" until the last response)."""
    return [r for r in collected.output("finish_reason") if r != b"None"]


def _ask_many(server, requests: dict[str, tuple[str, dict, bool, dict]]) -> dict:
    """{id: (prompt, sampling, stream, flags)} sent together on one gRPC stream (batched by the server); each
    request's Collected answer."""
    grpc = GrpcStream(server)
    try:
        for rid, (prompt, sampling, stream, flags) in requests.items():
            grpc.send(rid, grpc_inputs(prompt, stream=stream, sampling=sampling, **flags))
        return grpc.wait_all()
    finally:
        grpc.close()


def test_outputs_follow_each_constraint_over_grpc_streaming(triton_server):
    results = _ask_many(triton_server, {kind: (PROMPT, {**SAMPLED, "structured_outputs": constraint}, True, FLAGS)
                                        for kind, (constraint, _) in CONSTRAINTS.items()})
    for kind, (_, check) in CONSTRAINTS.items():
        got = results[kind]
        assert not got.errors and got.finals == 1, (kind, got.errors)
        assert len(got.responses) > 1 or kind == "choice", kind  # streamed: the text came in deltas
        check(got.text())
        assert _finish_reasons(got) == [b"stop"], (kind, got.output("finish_reason"), got.text())


def test_outputs_follow_each_constraint_over_http_generate(triton_server):
    """Unary HTTP generate, the constraint sent under the older name guided_decoding as a JSON string."""
    def generate(constraint: dict):
        sampling = {**SAMPLED, "guided_decoding": json.dumps(constraint)}
        return http_generate(triton_server, {"text_input": PROMPT, "sampling_parameters": json.dumps(sampling),
                                             **FLAGS})

    with ThreadPoolExecutor(len(CONSTRAINTS)) as pool:
        responses = dict(zip(CONSTRAINTS, pool.map(generate, [c for c, _ in CONSTRAINTS.values()])))
    for kind, (_, check) in CONSTRAINTS.items():
        response = responses[kind]
        assert response.status_code == 200, (kind, response.text)
        body = response.json()
        check(body["text_output"])
        assert body["finish_reason"] == "stop", (kind, body)


def test_n_3_samples_all_validate(triton_server):
    sampling = {**SAMPLED, "n": 3, "best_of": 3, "structured_outputs": CONSTRAINTS["json"][0]}
    got = ask(triton_server, PROMPT, sampling, stream=False, **FLAGS)
    assert not got.errors and got.finals == 1 and len(got.responses) == 1, got.errors
    final = got.responses[0]
    texts = [t.decode() for t in final.as_numpy("text_output")]
    assert len(texts) == 3
    for text in texts:
        jsonschema.validate(json.loads(text), TOOL_SCHEMA)
    assert [r.decode() for r in final.as_numpy("finish_reason")] == ["stop"] * 3
    assert len(set(texts)) > 1, texts  # three samples, each seeded on its own: not one output thrice


def test_stop_string_cuts_a_constrained_output(triton_server):
    sampling = {**SAMPLED, "stop": ['"units"'], "structured_outputs": CONSTRAINTS["json"][0]}
    got = ask(triton_server, PROMPT, sampling, stream=True, **FLAGS)
    assert not got.errors and got.finals == 1, got.errors
    text = got.text()
    assert text.startswith('{"city":"') and text.endswith(",") and '"units"' not in text, text
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)  # cut by the stop string, not ended by the grammar
    assert _finish_reasons(got) == [b"stop"], got.output("finish_reason")


# ---- the OpenAI frontend's forced tool call --------------------------------------------------------
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_current_weather",
    "description": "Get the weather forecast for a location",
    "parameters": {
        "type": "object",
        "properties": {
            "location": {"type": "string", "enum": ["Paris, France", "Lima, Peru", "Oslo, Norway"]},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
            "include_hourly": {"type": "boolean"},
        },
        "required": ["location", "unit", "days", "include_hourly"],
        "additionalProperties": False,
    },
}}
AIR_TOOL = {"type": "function", "function": {
    "name": "get_air_quality",
    "description": "Get the air quality index for a city",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "enum": ["Paris", "Lima", "Oslo"]},
            "hours": {"type": "integer", "minimum": 1, "maximum": 48},
            "include_pollen": {"type": "boolean"},
        },
        "required": ["city", "hours", "include_pollen"],
        "additionalProperties": False,
    },
}}
TOOLS = [WEATHER_TOOL, AIR_TOOL]
MESSAGES = [{"role": "user", "content": "What will the weather be like in Oslo this week? Use a tool."}]


def _frontend_structured_outputs(parameters: dict) -> str:
    """What the OpenAI frontend's converter sends for a forced tool call: its structured-outputs params as a JSON
    string, every field present, the tool's parameters schema itself a JSON string."""
    return json.dumps({"json": json.dumps(parameters), "regex": None, "choice": None, "grammar": None,
                       "json_object": None, "disable_fallback": False, "disable_any_whitespace": False,
                       "disable_additional_properties": False, "whitespace_pattern": None, "structural_tag": None,
                       "_backend": None, "_backend_was_auto": False})


def _chat_prompt() -> str:
    """MESSAGES through the default model's chat template, as the frontend renders a chat request."""
    from transformers import AutoTokenizer

    from backend.models.default_model import DEFAULT_ALIAS, resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(DEFAULT_ALIAS))
    return tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)


def test_forced_tool_call_from_the_openai_frontend_returns_valid_arguments(triton_server):
    """tool_choice naming get_air_quality (unary) and "required" (the first tool, get_current_weather; streamed):
    each request's arguments validate against its tool's schema and not the other's."""
    prompt = _chat_prompt()
    chat = {**CHAT, "temperature": 1.0, "max_tokens": 150}
    forced = {"named": (AIR_TOOL, False), "required": (TOOLS[0], True)}
    results = _ask_many(triton_server, {
        name: (prompt, {**chat, "structured_outputs": _frontend_structured_outputs(tool["function"]["parameters"])},
               stream, FRONTEND_FLAGS)
        for name, (tool, stream) in forced.items()})
    for name, (tool, _) in forced.items():
        got = results[name]
        assert not got.errors and got.finals == 1, (name, got.errors)
        arguments = json.loads(got.text())
        jsonschema.validate(arguments, tool["function"]["parameters"])
        other = AIR_TOOL if tool is WEATHER_TOOL else WEATHER_TOOL
        assert not jsonschema.Draft202012Validator(other["function"]["parameters"]).is_valid(arguments), arguments
        assert sum(got.output("num_output_tokens")) < chat["max_tokens"]  # ended by the grammar, not by length


# ---- bad constraints ---------------------------------------------------------------------------------
@pytest.mark.parametrize("extra, messages", [
    ({"structured_outputs": {"json": TOOL_SCHEMA, "regex": "a+"}},
     ["structured_outputs: give exactly one of", "not json and regex together"]),
    ({"structured_outputs": json.dumps({"regex": "a+", "tool": "x"})},
     ["structured_outputs: unknown field tool"]),
    ({"structured_outputs": {"regex": "(unclosed"}},
     ["structured_outputs.regex cannot be used", "unclosed group"]),
    ({"structured_outputs": {"grammar": "start: @@@"}},
     ["structured_outputs.grammar cannot be used"]),
    ({"structured_outputs": {"json": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}}},
     ["structured_outputs.json cannot be used", "uniqueItems"]),
    ({"guided_decoding": {"json": TOOL_SCHEMA}, "structured_outputs": {"regex": "a+"}},
     ["give structured_outputs or its older name guided_decoding, not both"]),
    ({"guided_decoding": json.dumps({"regex": "a+", "choice": ["a"]})},
     ["guided_decoding: give exactly one of", "not regex and choice together"]),
], ids=["two-constraints", "unknown-field", "bad-regex", "bad-grammar", "unsupported-keyword", "both-keys",
        "guided-decoding-two-constraints"])
def test_bad_constraint_is_invalid_arg_and_the_server_keeps_serving(triton_server, extra, messages):
    sampling = {**SAMPLED, **extra}
    response = http_generate(triton_server, {"text_input": PROMPT, "sampling_parameters": json.dumps(sampling)})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    for message in messages:
        assert message in error, error
    streamed = ask(triton_server, PROMPT, sampling, stream=True)
    assert len(streamed.errors) == 1 and not streamed.responses, streamed.errors
    assert messages[0] in streamed.errors[0].message(), streamed.errors[0].message()
    good = http_generate(triton_server, {"text_input": PROMPT, **FLAGS, "sampling_parameters": json.dumps(
        {**SAMPLED, "structured_outputs": {"choice": ["yes", "no"]}})})
    assert good.status_code == 200, good.text
    assert good.json()["text_output"] in ("yes", "no") and good.json()["finish_reason"] == "stop", good.json()


def test_bans_that_conflict_with_the_grammar_are_invalid_arg_after_the_tokens_before(triton_server):
    """A request whose bad_words or allowed_token_ids ban every token its grammar allows next is at fault: its one
    final response is INVALID_ARG (400 over HTTP) saying so, after the tokens it made; the server keeps serving."""
    before = settled_error_counts(triton_server)
    disjoint = {**SAMPLED, "structured_outputs": {"choice": CHOICES}, "allowed_token_ids": [28, 29]}
    response = http_generate(triton_server, {"text_input": PROMPT, "sampling_parameters": json.dumps(disjoint)})
    assert response.status_code == 400, response.text
    assert response.json()["error"] == ("no token may follow the first 0 output tokens: its allowed_token_ids ban "
                                        "every token its structured output allows there; loosen one of them")
    cities = {"max_tokens": 80, "temperature": 0, "bad_words": ["Lima", "Paris", "Oslo"],
              "structured_outputs": CONSTRAINTS["json"][0]}
    streamed = ask(triton_server, PROMPT, cities, stream=True, **FLAGS)
    assert len(streamed.errors) == 1 and streamed.finals == 1, streamed.errors
    assert "its bad_words ban every token its structured output allows" in streamed.errors[0].message()
    assert streamed.text().startswith('{"city":"'), streamed.text()  # the tokens before the conflict were sent
    wait_for(lambda: error_counts(triton_server)["INVALID_ARG"] >= before["INVALID_ARG"] + 2, 10,
             "the INVALID_ARG count")
    assert settled_error_counts(triton_server) == {**before, "INVALID_ARG": before["INVALID_ARG"] + 2}
    good = ask(triton_server, PROMPT, {**SAMPLED, "structured_outputs": {"choice": CHOICES}}, stream=True, **FLAGS)
    assert not good.errors and good.text() in CHOICES, (good.errors, good.text())


# ---- cancellation ---------------------------------------------------------------------------------
def test_cancelled_constrained_stream_frees_its_resources(triton_server):
    """A constrained stream that would run long (the model counts on in a JSON array of integers) is cancelled after
    its first response: it ends as aborted, generation stops, and the next constrained request is served."""
    aborts = scrape_finished(triton_server, "abort")
    generated = scrape(triton_server, "tandem_generation_tokens_total")
    max_tokens = 900
    long = {"max_tokens": max_tokens, "temperature": 0,
            "structured_outputs": {"json": {"type": "array", "items": {"type": "integer"}},
                                   "disable_any_whitespace": True}}
    stream = GrpcStream(triton_server)
    try:
        stream.send("long", grpc_inputs("Count from 1 to 500 as a JSON array: ", sampling=long))
        stream.next_event(timeout=60)
        assert not stream.results["long"].errors, stream.results["long"].errors
        assert stream.results["long"].text().startswith("["), stream.results["long"].text()
        wait_for(lambda: scrape(triton_server, "tandem_num_requests_running") > 0, 10, "the request to be running")
    finally:
        stream.close(cancel=True)
    wait_for(lambda: scrape(triton_server, "tandem_kv_cache_blocks_used") == 0
             and scrape(triton_server, "tandem_num_requests_running") == 0, 20, "KV blocks freed after cancel")
    wait_for(lambda: scrape_finished(triton_server, "abort") == aborts + 1, 10, "the request to end as aborted")
    assert scrape(triton_server, "tandem_generation_tokens_total") - generated < max_tokens / 3  # it stopped early
    got = ask(triton_server, PROMPT, {**SAMPLED, "structured_outputs": CONSTRAINTS["json"][0]}, stream=True, **FLAGS)
    assert not got.errors and got.finals == 1, got.errors
    jsonschema.validate(json.loads(got.text()), TOOL_SCHEMA)
    assert _finish_reasons(got) == [b"stop"]
