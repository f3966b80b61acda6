"""The decode rows' penalty token tables are kept per row: equal to each request's own lists at every step, through
tokens arriving and rows leaving and joining."""
from __future__ import annotations

import numpy as np

from backend.core.running_batch import RunningBatch
from backend.executor.penalty_tokens import RowPenaltyTokens
from backend.request import Request, SamplingParams


def _request(i: int) -> Request:
    req = Request(f"r{i}", list(range(10 + i, 15 + 2 * i)), SamplingParams(max_tokens=500, frequency_penalty=0.5),
                  seed=i, eos_token_ids=frozenset({2}))
    req.output_token_ids = [100 + i]  # one output read: this step feeds it and samples the next token
    req.num_computed_tokens = req.num_prompt_tokens + 1
    req.num_tokens = req.num_prompt_tokens + 2
    req.block_ids = list(range(1 + 40 * i, 41 + 40 * i))
    return req


def _want(rb: RunningBatch) -> tuple[list[list[int]], list[list[int]]]:
    """Each row's prompt and its outputs before the token the step feeds, from the request's lists."""
    return ([r.prompt_token_ids for r in rb.requests],
            [r.output_token_ids[:r.num_computed_tokens - 1 - r.num_prompt_tokens] for r in rb.requests])


def test_row_penalty_tokens_follow_tokens_and_row_changes():
    rb = RunningBatch(block_size=16, max_model_len=4096, max_blocks=64)
    rb._append([_request(i) for i in range(5)], np.arange(5))
    kept = RowPenaltyTokens()
    rng = np.random.default_rng(3)
    joined = 5
    for step in range(150):  # more outputs than the first buffer holds (64)
        if step % 40 == 39:
            rb._delete(np.array([int(rng.integers(len(rb)))]))
            rb._append([_request(joined)], np.array([0]))
            joined += 1
        rb.advance(step)
        prompts, outputs = kept.tables(rb)
        want_prompts, want_outputs = _want(rb)
        assert [p.tolist() for p in prompts] == want_prompts
        assert [o.tolist() for o in outputs] == want_outputs
        for req in rb.requests:  # the step's tokens arrive
            req.output_token_ids.append(int(rng.integers(1000)))
    assert max(len(o) for o in outputs) > 64 and joined == 8
