"""Property-based fuzzing of the adapter's request parser: whatever tensors and JSON arrive (deep nesting, huge
numbers, bad UTF-8, wrong types, unknown keys), parse_request returns a request or raises ValueError with a
message; nothing else escapes (anything else would reach the client as INTERNAL instead of INVALID_ARG)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, given, settings, strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "model_repository" / "llm" / "1"))
from protocol import ParsedRequest, parse_request  # noqa: E402

KNOWN_KEYS = ["max_tokens", "min_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "stop", "stop_token_ids",
              "ignore_eos", "logprobs", "top_logprobs", "n", "best_of", "logit_bias", "allowed_token_ids", "bad_words",
              "truncate_prompt_tokens", "prompt_logprobs", "repetition_penalty", "presence_penalty",
              "frequency_penalty", "skip_special_tokens", "include_stop_str_in_output", "detokenize", "lora_name",
              "guided_decoding"]
JSON_LEAVES = (st.none() | st.booleans() | st.integers(min_value=-(10**30), max_value=10**30)
               | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=8))
JSON_VALUES = st.recursive(JSON_LEAVES, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=4), inner, max_size=4), max_leaves=12)
SAMPLING = st.dictionaries(st.sampled_from(KNOWN_KEYS) | st.text(max_size=6), JSON_VALUES, max_size=6)


def _nested(depth: int) -> str:
    return '{"stop": ' + "[" * depth + "]" * depth + "}"


RAW_SAMPLING = st.one_of(
    SAMPLING.map(lambda d: json.dumps(d, allow_nan=True).encode()),
    st.integers(min_value=900, max_value=5000).map(lambda d: _nested(d).encode()),  # RecursionError territory
    st.integers(min_value=4301, max_value=6000).map(lambda n: ('{"seed": 1' + "0" * n + "}").encode()),
    st.binary(max_size=40),  # anything, bad UTF-8 included
    st.text(max_size=40).map(str.encode),
)
PROMPT = st.one_of(
    st.binary(max_size=30).map(lambda b: ("text_input", np.array([b], dtype=np.object_))),
    st.lists(st.binary(max_size=5), max_size=3).map(lambda bs: ("text_input", np.array(bs, dtype=np.object_))),
    st.lists(st.integers(min_value=-(2**63), max_value=2**63 - 1), max_size=5).map(
        lambda ids: ("input_ids", np.array(ids, dtype=np.int64))),
    st.lists(st.floats(width=32, allow_nan=True), max_size=3).map(lambda xs: ("input_ids", np.array(xs, dtype=np.float32))),
)
FLAG = st.one_of(st.none(), st.lists(st.booleans(), min_size=0, max_size=2).map(np.array))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompt=PROMPT, raw=st.none() | RAW_SAMPLING, stream=FLAG, exclude=FLAG, logprobs_flag=FLAG,
       http_parameters=st.none() | SAMPLING.map(json.dumps) | st.text(max_size=20))
def test_parser_returns_a_request_or_a_value_error(prompt, raw, stream, exclude, logprobs_flag, http_parameters):
    tensors = {prompt[0]: prompt[1], "stream": stream, "exclude_input_in_output": exclude,
               "return_logprobs": logprobs_flag}
    if raw is not None:
        tensors["sampling_parameters"] = np.array([raw], dtype=np.object_)
    try:
        parsed = parse_request(tensors.get, http_parameters)
    except ValueError as err:
        assert str(err)  # a message that says what to fix
        return
    assert isinstance(parsed, ParsedRequest)
    parsed.params.validate()  # what came out is a valid request


def test_deep_nesting_and_huge_numbers_name_the_field():
    """The cases that escaped as RecursionError or Python's own message before."""
    base = {"text_input": np.array([b"Hi"], dtype=np.object_)}
    for raw, message in ((_nested(1000), "sampling_parameters: JSON nested too deeply"),
                         ('{"seed": 1' + "0" * 5000 + "}", "sampling_parameters: a value is out of range"),
                         (b'{"stop": "\xff\xfe"}', "sampling_parameters must be UTF-8 text"),
                         ('{"temperature": 1' + "0" * 400 + "}", "temperature must be a finite number")):
        tensors = {**base, "sampling_parameters": np.array([raw if isinstance(raw, bytes) else raw.encode()],
                                                           dtype=np.object_)}
        try:
            parse_request(tensors.get, None)
        except ValueError as err:
            assert message in str(err), (message, str(err))
        else:
            raise AssertionError(f"accepted {raw[:40]!r}")
