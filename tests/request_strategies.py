"""Hypothesis strategies for fuzzing requests: sampling objects of known and unknown keys with any JSON values, raw
sampling_parameters bytes (deep nesting, huge numbers, bad UTF-8), prompts and flags of odd shapes and types."""
from __future__ import annotations

import json

import numpy as np
from hypothesis import strategies as st

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


def nested(depth: int) -> str:
    """A sampling object whose stop value is a list nested depth levels deep."""
    return '{"stop": ' + "[" * depth + "]" * depth + "}"


RAW_SAMPLING = st.one_of(
    SAMPLING.map(lambda d: json.dumps(d, allow_nan=True).encode()),
    st.integers(min_value=900, max_value=5000).map(lambda d: nested(d).encode()),  # RecursionError territory
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
