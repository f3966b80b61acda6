"""Structured outputs through the engine on the CPU, with the default model's real tokenizer: every output of a JSON
schema, regex, choice or grammar request follows it, sampled at temperature 1.0, with n = 3, beside unconstrained
requests, in both pipeline modes, through preemption; a bad constraint is a ValueError that names what is wrong.
(The OpenAI frontend's forced tool call is replayed through tritonserver: test_structured_outputs.py there.)"""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from backend import Engine, EngineConfig, SamplingParams
from tests.structured_cases import CHOICES, GRAMMAR, GRAMMAR_LANGUAGE, PROMPT, REGEX, TOOL_SCHEMA



def _engine(async_pipeline: bool, like: Engine | None = None, **settings) -> Engine:
    """An engine on the CPU over the default model; like: share that engine's loaded model and tokenizer."""
    config = EngineConfig(**{**dict(device="cpu", num_kv_blocks=256, max_num_seqs=8, max_model_len=1024,
                                    async_pipeline=async_pipeline), **settings})
    if like is None:
        return Engine(config)
    return Engine(config, model=like.parts.model, tokenizer=like.tokenizer)


@pytest.fixture(scope="module")
def engine():
    eng = _engine(async_pipeline=True)
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


@pytest.mark.parametrize("async_pipeline", [True, False], ids=["async", "sync"])
def test_regex_choice_and_grammar_outputs_match(engine, async_pipeline):
    """In both pipeline modes (sync: the step's sampling follows its forward with no step in between)."""
    eng = engine if async_pipeline else _engine(async_pipeline=False, like=engine)
    try:
        outs = eng.generate([PROMPT] * 3, [_sampled({"regex": REGEX}), _sampled({"choice": CHOICES}),
                                           _sampled({"grammar": GRAMMAR})])
    finally:
        if eng is not engine:
            eng.shutdown()
    assert re.fullmatch(REGEX, outs[0].text), outs[0].text
    assert outs[1].text in CHOICES
    assert re.fullmatch(GRAMMAR_LANGUAGE, outs[2].text), outs[2].text


def test_greedy_constrained_output_stops_where_the_stop_string_cuts_it(engine):
    params = SamplingParams(max_tokens=80, temperature=0.0, stop=['"days"'],
                            structured_outputs={"json": TOOL_SCHEMA, "disable_any_whitespace": True})
    out = engine.generate([PROMPT], params)[0]
    assert out.finish_reason == "stop"
    assert out.text.startswith("{") and '"days"' not in out.text


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


DIGITS_12 = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 12,
             "maxItems": 12}


def test_constrained_rows_stay_valid_through_preemption(engine):
    """A cache too small for all rows preempts some mid-output; each keeps its matcher and its tokens, so every
    output still validates."""
    small = _engine(async_pipeline=True, like=engine, num_kv_blocks=6, max_num_seqs=4, max_model_len=128)
    try:
        params = [_sampled({"json": DIGITS_12, "disable_any_whitespace": True}, seed=i, max_tokens=40)
                  for i in range(4)]
        outs = small.generate(["Twelve digits:"] * 4, params)
        assert small.stats()["preemptions"] > 0
    finally:
        small.shutdown()
    for out in outs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), DIGITS_12)


def test_logprobs_of_constrained_rows_are_those_of_the_masked_distribution(engine):
    """Logprobs come from the logits the sampler read, the grammar's mask applied: a greedy constrained token is
    rank 1 there, and every token the grammar banned has -inf."""
    params = SamplingParams(max_tokens=16, temperature=0.0, logprobs=3,
                            structured_outputs={"choice": ["alpha", "omega"]})
    out = engine.generate([PROMPT], params)[0]
    assert out.text in ("alpha", "omega")
    assert [e["token_id"] for e in out.logprobs] == out.token_ids
    for entry in out.logprobs:
        assert entry["rank"] == 1 and entry["logprob"] > float("-inf")
        assert entry["top_logprobs"][0]["token_id"] == entry["token_id"]


def test_logit_bias_cannot_break_the_grammar(engine):
    """A +100 bias on tokens the grammar bans does not bring them back: the outputs are still choices."""
    tok = engine.tokenizer
    pushed = {t: 100.0 for t in tok.encode(" the of and to a in", add_special_tokens=False)}
    outs = engine.generate([PROMPT] * 4, [_sampled({"choice": ["Paris", "Lima"]}, logit_bias=pushed, seed=s)
                                          for s in range(4)])
    assert all(o.text in ("Paris", "Lima") for o in outs), [o.text for o in outs]


def test_the_grammar_library_is_prepared_at_start_up_not_on_the_first_request(engine, monkeypatch):
    """The engine builds the grammar library's tokenizer view on a helper thread as it starts (it holds the GIL
    for about half a second on this vocabulary), so the first structured request only compiles its grammar; with
    grammar_warmup off it is built for the first structured request."""
    import time

    import backend.structured.grammar as grammar

    engine.intake.prepare_grammars().join(timeout=60)  # the shared engine's own start-up helper is done
    built = []
    real = grammar.GrammarCompiler
    monkeypatch.setattr(grammar, "GrammarCompiler", lambda *a, **kw: built.append(1) or real(*a, **kw))
    params = _sampled({"choice": CHOICES}, max_tokens=8)
    warm = _engine(async_pipeline=True, like=engine)
    cold = _engine(async_pipeline=True, like=engine, grammar_warmup=False)
    try:
        deadline = time.monotonic() + 60
        while not built and time.monotonic() < deadline:  # no request sent: the start-up helper builds it
            time.sleep(0.05)
        assert built == [1]
        assert warm.generate([PROMPT], params)[0].text in CHOICES
        assert cold.generate([PROMPT], SamplingParams(max_tokens=4))[0].token_ids
        assert built == [1]
        assert cold.generate([PROMPT], params)[0].text in CHOICES
        assert built == [1, 1]
    finally:
        warm.shutdown()
        cold.shutdown()


@pytest.mark.parametrize("kind, structured, stop, cut", [
    ("regex", {"regex": REGEX}, ["-"], lambda text: re.fullmatch(r"[A-Z][a-z]{2,6}", text)),
    ("choice", {"choice": CHOICES}, ["e"], lambda text: text in {c.split("e")[0] for c in CHOICES}),
    ("grammar", {"grammar": GRAMMAR}, [" is"], lambda text: text == "The answer"),
])
def test_n_3_and_stop_strings_on_each_kind(engine, kind, structured, stop, cut):
    """Three samples each follow the constraint with a matcher of their own; a stop string cuts a constrained
    output as it cuts a free one."""
    outs = engine.generate([PROMPT], _sampled(structured, n=3))
    assert len(outs) == 3 and all(o.finish_reason == "stop" for o in outs)
    if kind == "regex":
        assert all(re.fullmatch(REGEX, o.text) for o in outs), [o.text for o in outs]
    elif kind == "choice":
        assert all(o.text in CHOICES for o in outs), [o.text for o in outs]
    else:
        assert all(re.fullmatch(GRAMMAR_LANGUAGE, o.text) for o in outs), [o.text for o in outs]
    cut_outs = engine.generate([PROMPT], _sampled(structured, n=3, stop=stop))
    for out in cut_outs:
        assert out.finish_reason == "stop" and cut(out.text), out.text


def test_a_stop_token_ends_a_constrained_row_where_it_comes(engine):
    """stop_token_ids end a constrained row as they end a free one: the greedy output up to that token, which is
    kept in the token ids and left out of the text."""
    schema = {"json": TOOL_SCHEMA, "disable_any_whitespace": True}
    full = engine.generate([PROMPT], SamplingParams(max_tokens=80, temperature=0.0, structured_outputs=schema))[0]
    stop = full.token_ids[6]
    first = full.token_ids.index(stop)
    cut = engine.generate([PROMPT], SamplingParams(max_tokens=80, temperature=0.0, structured_outputs=schema,
                                                   stop_token_ids=[stop]))[0]
    assert cut.finish_reason == "stop"
    assert cut.token_ids == full.token_ids[:first + 1]
    assert cut.text == engine.tokenizer.decode(full.token_ids[:first])


def test_min_tokens_holds_off_the_end_but_not_the_grammars_end(engine):
    """min_tokens bans stop tokens while the grammar could go on, so an open pattern runs to the minimum; a grammar
    that can take no more token (a complete choice) ends the row there, however short."""
    open_pattern = engine.generate([PROMPT], SamplingParams(max_tokens=40, temperature=0.0, min_tokens=12,
                                                            structured_outputs={"regex": "[a-z ]+"}))[0]
    assert len(open_pattern.token_ids) >= 12 and re.fullmatch("[a-z ]+", open_pattern.text), open_pattern.text
    complete = engine.generate([PROMPT], SamplingParams(max_tokens=10, temperature=0.0, min_tokens=5,
                                                        structured_outputs={"choice": ["ok"]}))[0]
    assert complete.finish_reason == "stop" and complete.text == "ok" and len(complete.token_ids) < 5


def test_bans_that_leave_the_grammar_no_token_end_that_row_with_an_error_that_says_so(engine):
    """bad_words or allowed_token_ids may ban every token the grammar allows next (the request's own constraints
    conflict): that row ends with an error naming them, a request beside it is served, every KV block returns."""
    hello = engine.tokenizer.encode("Hello", add_special_tokens=False)
    schema = {"json": TOOL_SCHEMA, "disable_any_whitespace": True}
    conflicting = [
        SamplingParams(max_tokens=8, temperature=0.0, allowed_token_ids=hello, structured_outputs={"choice": CHOICES}),
        # greedy: the model picks a city by its first letter, whose only continuations the bans take away
        SamplingParams(max_tokens=80, temperature=0.0, bad_words=["Lima", "Paris", "Oslo"], structured_outputs=schema),
    ]
    free = SamplingParams(max_tokens=16, temperature=1.0, seed=3, ignore_eos=True)
    outs = engine.generate([PROMPT, PROMPT, "Tell me a story."], [*conflicting, free])
    allowed, banned, beside = outs
    assert allowed.finish_reason == "error" and allowed.invalid_request and allowed.token_ids == []
    assert allowed.error == ("no token may follow the first 0 output tokens: its allowed_token_ids ban every token "
                             "its structured output allows there; loosen one of them")
    assert banned.finish_reason == "error" and banned.invalid_request
    assert "its bad_words ban every token its structured output allows" in banned.error
    assert banned.text.startswith('{"city":"') and not any(c in banned.text for c in ("Lima", "Paris", "Oslo"))
    assert beside.finish_reason == "length" and len(beside.token_ids) == 16
    assert engine.stats()["kv_blocks_used"] == 0


def test_json_object_outputs_are_json_objects(engine):
    prompt = "Reply with a JSON object giving a person's name and age."
    outs = engine.generate([prompt] * 4, [_sampled({"json_object": True}, seed=s, max_tokens=160) for s in range(4)])
    for out in outs:
        assert out.finish_reason == "stop", out.text
        assert isinstance(json.loads(out.text), dict), out.text


def test_json_options_shape_the_output(engine):
    """whitespace_pattern bounds the whitespace between JSON tokens; disable_additional_properties keeps an object
    to the properties its schema names."""
    spaced = engine.generate([PROMPT], _sampled({"json": TOOL_SCHEMA, "whitespace_pattern": "[ ]?"}, seed=2))[0]
    assert spaced.finish_reason == "stop"
    jsonschema.validate(json.loads(spaced.text), TOOL_SCHEMA)
    assert not re.search(r"[\t\n]| {2}", spaced.text), spaced.text
    open_schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    closed = {**open_schema, "additionalProperties": False}
    outs = engine.generate([PROMPT] * 4, [_sampled({"json": open_schema, "disable_additional_properties": True,
                                                     "disable_any_whitespace": True}, seed=s) for s in range(4)])
    for out in outs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), closed)


FN_ADD = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
FN_TAG = {"type": "structural_tag", "triggers": ["<fn"],
          "structures": [{"begin": "<fn=add>", "schema": FN_ADD, "end": "</fn>"}]}


def test_a_structural_tag_holds_the_call_to_its_schema(engine):
    """Free text until a trigger, then the tagged call's schema. A bias on '<' and 'fn' makes the model call; the
    stop string ends the output at the call's end tag, so the call's arguments are the text after the begin tag."""
    tok = engine.tokenizer
    push = {tok.encode(t, add_special_tokens=False)[0]: 6.0 for t in ("<", "fn")}
    params = [_sampled({"structural_tag": FN_TAG, "disable_any_whitespace": True}, seed=s, max_tokens=40,
                       logit_bias=push, stop=["</fn>"]) for s in range(3)]
    calls = [out.text.split("<fn=add>", 1)[1] for out in engine.generate(["Add 3 by calling <fn=add>."] * 3, params)
             if out.finish_reason == "stop" and "<fn=add>" in out.text]
    assert calls, "no output made a call"
    for arguments in calls:
        jsonschema.validate(json.loads(arguments), FN_ADD)
