"""Structured outputs through the engine on the CPU, with the default model's real tokenizer: every output of a JSON
schema, regex, choice or grammar request follows it, sampled at temperature 1.0, with n = 3, beside unconstrained
requests, in both pipeline modes; a bad constraint is a ValueError that names what is wrong."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from backend import Engine, EngineConfig, SamplingParams

TOOL_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Lima", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "units": {"type": "string", "enum": ["metric", "imperial"]},
        "alerts": {"type": "boolean"},
    },
    "required": ["city", "days", "units", "alerts"],
    "additionalProperties": False,
}
PROMPT = "Call the weather tool for a city as JSON."


@pytest.fixture(scope="module", params=[True, False], ids=["async", "sync"])
def engine(request):
    eng = Engine(EngineConfig(device="cpu", num_kv_blocks=256, max_num_seqs=8, max_model_len=1024,
                              async_pipeline=request.param))
    yield eng
    eng.shutdown()


def _sampled(structured, **kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 80, "temperature": 1.0, "seed": 7, "structured_outputs": structured, **kw})


def test_json_schema_outputs_validate_with_n_3_beside_free_requests(engine):
    constrained = _sampled({"json": TOOL_SCHEMA, "disable_any_whitespace": True}, n=3)
    free = SamplingParams(max_tokens=24, temperature=1.0, seed=3)
    outs = engine.generate([PROMPT, "Say hello.", PROMPT], [constrained, free, constrained])
    json_outs = outs[:3] + outs[4:]
    assert len(outs) == 7
    for out in json_outs:
        assert out.finish_reason == "stop", (out.finish_reason, out.text)
        jsonschema.validate(json.loads(out.text), TOOL_SCHEMA)
    assert len({o.text for o in json_outs[:3]}) > 1  # three samples, three matchers, not one output thrice
    assert outs[3].text and outs[3].finish_reason in ("stop", "length")


def test_regex_choice_and_grammar_outputs_match(engine):
    regex = r"[A-Z][a-z]{2,6}-[0-9]{3}"
    choices = ["red", "green", "blue"]
    grammar = 'start: "The answer is " ANSWER "."\nANSWER: "yes" | "no"\n'
    outs = engine.generate([PROMPT] * 3, [_sampled({"regex": regex}), _sampled({"choice": choices}),
                                          _sampled({"grammar": grammar})])
    assert re.fullmatch(regex, outs[0].text), outs[0].text
    assert outs[1].text in choices
    assert re.fullmatch(r"The answer is (yes|no)\.", outs[2].text), outs[2].text


def test_greedy_constrained_output_stops_where_the_stop_string_cuts_it(engine):
    params = SamplingParams(max_tokens=80, temperature=0.0, stop=['"days"'],
                            structured_outputs={"json": TOOL_SCHEMA, "disable_any_whitespace": True})
    out = engine.generate([PROMPT], params)[0]
    assert out.finish_reason == "stop"
    assert out.text.startswith("{") and '"days"' not in out.text


def test_the_openai_frontends_forced_tool_call_request_validates(engine):
    """What the OpenAI frontend sends for a forced tool call: every field of the params present, most null."""
    sent = json.dumps({"json": json.dumps(TOOL_SCHEMA), "regex": None, "choice": None, "grammar": None,
                       "json_object": None, "disable_fallback": False, "disable_any_whitespace": False,
                       "disable_additional_properties": False, "whitespace_pattern": None, "structural_tag": None,
                       "_backend": None, "_backend_was_auto": False})
    out = engine.generate([PROMPT], _sampled(sent, max_tokens=120))[0]
    assert out.finish_reason == "stop", out.text
    jsonschema.validate(json.loads(out.text), TOOL_SCHEMA)


@pytest.mark.parametrize("structured, message", [
    ({"json": TOOL_SCHEMA, "regex": "a+"}, "json"),
    ({"regex": "(unclosed"}, "regex"),
    ({"grammar": "start: @@@"}, "grammar"),
    ({"tool": "x"}, "tool"),
])
def test_bad_constraints_are_errors_and_the_engine_keeps_serving(engine, structured, message):
    with pytest.raises(ValueError, match=message):
        engine.generate([PROMPT], _sampled(structured))
    out = engine.generate([PROMPT], _sampled({"choice": ["ok"]}))[0]
    assert out.text == "ok"
