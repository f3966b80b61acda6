"""The scheduler's decisions, step by step, through the whole engine loop with the stand-in model (instant tokens):
chunked prefill within the token budget, running requests before waiting ones, the seat limit, arrival order,
preemption by recompute of the newest request, and every step as a reference model of those rules makes it."""
from __future__ import annotations

import pytest

from backend import Engine, EngineConfig, SamplingParams
from backend.models.standin import expected_tokens
from tests.tiny_models import kv_blocks_used_after_settling, random_prompts


def run(prompts, max_tokens, **settings):
    """Generate greedily (EOS ignored) and record every step as [(request id, tokens fed, samples), ...]."""
    config = dict(model="stand-in", device="cpu", num_kv_blocks=512, block_size=16, max_num_seqs=8,
                  max_num_batched_tokens=256, async_pipeline=False)
    engine = Engine(EngineConfig(**{**config, **settings}))
    steps: list[list[tuple[str, int, bool]]] = []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        batch = schedule()
        if batch is not None:
            steps.append([(r.request_id, n, s) for r, n, s in zip(batch.requests, batch.num_new_tokens,
                                                                   batch.samples)])
        return batch

    engine.scheduler.schedule = recording_schedule
    try:
        lengths = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
        outs = engine.generate(prompts, [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
                                         for n in lengths])
        assert [o.token_ids for o in outs] == [expected_tokens(p, n, 512) for p, n in zip(prompts, lengths)]
        assert kv_blocks_used_after_settling(engine) == 0
        return steps, engine.stats(), [o.request_id for o in outs]
    finally:
        engine.shutdown()


def test_a_long_prompt_is_fed_in_chunks_of_the_budget_and_samples_on_its_last():
    steps, _, ids = run(random_prompts([600], seed=1), 3)
    assert steps[:3] == [[(ids[0], 256, False)], [(ids[0], 256, False)], [(ids[0], 88, True)]]
    assert steps[3:] == [[(ids[0], 1, True)]] * 2  # then one token a step: 3 tokens in all


def test_running_requests_come_first_and_waiting_prompts_fill_the_rest_of_the_budget():
    prompts = random_prompts([40, 300], seed=2)
    steps, _, (first, second) = run(prompts, 6, max_num_batched_tokens=128)
    assert steps[0] == [(first, 40, True), (second, 88, False)]  # the second prompt takes what the first left
    assert steps[1] == [(first, 1, True), (second, 127, False)]  # a decode row costs one token of the budget
    assert steps[2] == [(first, 1, True), (second, 85, True)]
    assert all(step[0] == (first, 1, True) for step in steps[3:6])


def test_no_more_requests_run_than_seats_and_they_are_admitted_in_arrival_order():
    prompts = random_prompts([5] * 7, seed=3)
    steps, _, ids = run(prompts, 4, max_num_seqs=3)
    assert max(len(step) for step in steps) == 3
    admitted = []
    for step in steps:
        admitted += [rid for rid, _, _ in step if rid not in admitted]
    assert admitted == ids


def test_when_blocks_run_out_the_newest_requests_are_preempted_and_recomputed_in_arrival_order():
    # 4 requests of 20 + 60 tokens need 5 blocks of 16 each (20 blocks); 13 usable blocks cannot hold them all
    prompts = random_prompts([20] * 4, seed=4)
    steps, stats, ids = run(prompts, 60, num_kv_blocks=14, max_num_seqs=4)
    assert stats["preemptions"] == 2
    left = [next(i for i, step in enumerate(steps) if rid not in {r for r, _, _ in step}) for rid in ids[2:]]
    assert left[1] < left[0]  # the newest left first, then the next newest
    assert all(rid in {r for r, _, _ in step} for step in steps[:max(left)] for rid in ids[:2])  # the oldest ran on
    back = next(step for step in steps[max(left):] if any(n > 1 for _, n, _ in step))
    assert [rid for rid, n, _ in back if n > 1] == ids[2:]  # both recompute, in arrival order, in one step


@pytest.mark.parametrize("budget, seats", [(256, 8), (40, 5)])
def test_every_step_is_the_one_the_batching_rules_make(budget, seats):
    """Requests that finish at different steps, a queue longer than the seats, prompts of several chunks: every step
    feeds what a plain model of the rules feeds. Each decoding request one token; then the prefilling requests, in
    admission order, chunks of what budget is left; then waiting requests admitted in arrival order into the seats
    and budget left. A request whose prompt is done decodes from the next step; one that sampled its last token
    leaves (synchronous pipeline: each step's tokens are read before the next is scheduled)."""
    prompts = random_prompts([(37 * i) % 300 + 1 for i in range(24)], seed=5)
    lengths = [(11 * i) % 40 + 1 for i in range(24)]
    steps, _, ids = run(prompts, lengths, max_num_batched_tokens=budget, max_num_seqs=seats)
    want = _reference_steps([len(p) for p in prompts], lengths, budget, seats)
    assert len(steps) == len(want)
    index = {rid: i for i, rid in enumerate(ids)}
    for got, expected in zip(steps, want):
        assert sorted((index[rid], n, s) for rid, n, s in got) == sorted(expected)


def _reference_steps(prompt_lens, lengths, budget, seats):
    """The steps of the batching rules, as sorted (request index, tokens fed, samples) lists."""
    computed = [0] * len(prompt_lens)
    sampled = [0] * len(prompt_lens)
    waiting, running, steps = list(range(len(prompt_lens))), [], []
    while waiting or running:
        step, left = [], budget
        for i in running:  # decoding requests: their prompt is done
            if computed[i] >= prompt_lens[i]:
                step.append((i, 1, True))
                left -= 1
        for i in running:
            if computed[i] < prompt_lens[i] and left:
                n = min(prompt_lens[i] - computed[i], left)
                step.append((i, n, computed[i] + n == prompt_lens[i]))
                left -= n
        while waiting and left and len(running) < seats:
            i = waiting.pop(0)
            running.append(i)
            n = min(prompt_lens[i], left)
            step.append((i, n, n == prompt_lens[i]))
            left -= n
        for i, n, samples in step:
            computed[i] += n
            sampled[i] += samples
        running = [i for i in running if sampled[i] < lengths[i]]
        steps.append(step)
    return steps
