"""Request.token_slice: any window of prompt + outputs, on either side of the boundary or across it."""
from __future__ import annotations

import pytest

from backend import SamplingParams
from backend.request import Request


@pytest.mark.parametrize("start,end", [(0, 3), (1, 5), (5, 7), (2, 6), (0, 7), (4, 5), (6, 7), (3, 3)])
def test_token_slice_equals_slicing_the_joined_lists(start, end):
    req = Request("r", [10, 11, 12, 13, 14], SamplingParams(), seed=0, eos_token_ids=frozenset())
    req.output_token_ids = [20, 21]
    assert req.token_slice(start, end) == (req.prompt_token_ids + req.output_token_ids)[start:end]
