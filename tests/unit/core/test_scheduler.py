"""The scheduler's decisions, step by step, through the whole engine loop with the stand-in model (instant tokens):
chunked prefill within the token budget, running requests before waiting ones, the seat limit, arrival order,
preemption by recompute of the newest request, and the same steps whether decode runs take the array path or not."""
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


@pytest.mark.parametrize("steady_decode", [True, False], ids=["array-rows", "general"])
def test_when_blocks_run_out_the_newest_requests_are_preempted_and_recomputed_in_arrival_order(steady_decode):
    # 4 requests of 20 + 60 tokens need 5 blocks of 16 each (20 blocks); 13 usable blocks cannot hold them all
    prompts = random_prompts([20] * 4, seed=4)
    steps, stats, ids = run(prompts, 60, num_kv_blocks=14, max_num_seqs=4, steady_decode=steady_decode)
    assert stats["preemptions"] == 2
    left = [next(i for i, step in enumerate(steps) if rid not in {r for r, _, _ in step}) for rid in ids[2:]]
    assert left[1] < left[0]  # the newest left first, then the next newest
    assert all(rid in {r for r, _, _ in step} for step in steps[:max(left)] for rid in ids[:2])  # the oldest ran on
    back = next(step for step in steps[max(left):] if any(n > 1 for _, n, _ in step))
    assert [rid for rid, n, _ in back if n > 1] == ids[2:]  # both recompute, in arrival order, in one step


def test_decode_runs_on_array_rows_schedule_exactly_the_general_steps():
    """Requests that finish at different steps, a queue longer than the seats, prompts of several chunks: the steady
    array path must make the same steps as the general path."""
    prompts = random_prompts([(37 * i) % 300 + 1 for i in range(24)], seed=5)
    lengths = [(11 * i) % 40 + 1 for i in range(24)]
    steady, steady_stats, _ = run(prompts, lengths, steady_decode=True)
    general, general_stats, _ = run(prompts, lengths, steady_decode=False)
    assert steady_stats["steady_steps"] > 0 and general_stats["steady_steps"] == 0
    assert _without_ids(steady) == _without_ids(general)


def _without_ids(steps):
    """Each step as (tokens fed, samples) per row: request ids are numbered per engine."""
    return [[(n, s) for _, n, s in step] for step in steps]
