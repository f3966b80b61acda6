"""Property-based fuzzing of the adapter's request parser: whatever tensors and JSON arrive (deep nesting, huge
numbers, bad UTF-8, wrong types, unknown keys), parse_request returns a request or raises ValueError with a
message; nothing else escapes (anything else would reach the client as INTERNAL instead of INVALID_ARG)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, given, settings, strategies as st

from tests.request_strategies import FLAG, PROMPT, RAW_SAMPLING, SAMPLING, nested

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "model_repository" / "llm" / "1"))
from protocol import ParsedRequest, parse_request  # noqa: E402


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
    for raw, message in ((nested(1000), "sampling_parameters: JSON nested too deeply"),
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
