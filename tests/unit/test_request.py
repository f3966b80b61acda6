"""Request.token_slice: any window of prompt + outputs, on either side of the boundary or across it; SamplingParams'
seed: the generator's 64-bit range, for every sample."""
from __future__ import annotations

import pytest

from backend import SamplingParams
from backend.request import Request


@pytest.mark.parametrize("start,end", [(0, 3), (1, 5), (5, 7), (2, 6), (0, 7), (4, 5), (6, 7), (3, 3)])
def test_token_slice_equals_slicing_the_joined_lists(start, end):
    req = Request("r", [10, 11, 12, 13, 14], SamplingParams(), seed=0, eos_token_ids=frozenset())
    req.output_token_ids = [20, 21]
    assert req.token_slice(start, end) == (req.prompt_token_ids + req.output_token_ids)[start:end]


SEED_RANGE = "seed must be in [0, 18446744073709551615] (0 to 2**64 - 1, the generator's 64-bit range)"


@pytest.mark.parametrize("values, message", [
    ({"seed": 2**64}, f"{SEED_RANGE}, got 18446744073709551616"),
    ({"seed": 2**70}, f"{SEED_RANGE}, got 1180591620717411303424"),
    ({"seed": -1}, f"{SEED_RANGE}, got -1"),
    ({"seed": True}, "seed must be an integer, got True"),
    ({"seed": "7"}, "seed must be an integer, got '7'"),
    ({"seed": 2**64 - 2, "n": 3}, "seed + n - 1 must be at most 18446744073709551615 (sample i is seeded seed + i), "
                                  "got seed 18446744073709551614 with n 3"),
])
def test_seeds_outside_the_generators_range_are_refused(values, message):
    with pytest.raises(ValueError) as err:
        SamplingParams(**values)
    assert str(err.value) == message


@pytest.mark.parametrize("values", [{"seed": 0}, {"seed": 2**64 - 1}, {"seed": 2**64 - 3, "n": 3}])
def test_seeds_inside_the_range_are_kept(values):
    assert SamplingParams(**values).seed == values["seed"]
