"""Steady decode runs (backend/core/steady_batch.py) give exactly what the general path gives, and are taken."""
from __future__ import annotations

import pytest

from backend import Engine, EngineConfig, SamplingParams
from tests.tiny_models import build_tiny, hf_greedy, kv_blocks_used_after_settling, random_prompts

MODES = [pytest.param(False, id="sync"), pytest.param(True, id="async")]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tiny-steady"))


def make_engine(path, async_pipeline, steady=True, **kw) -> Engine:
    settings = dict(model=path, device="cpu", num_kv_blocks=400, block_size=4, max_num_batched_tokens=64,
                    max_num_seqs=16, async_pipeline=async_pipeline, steady_decode=steady)
    settings.update(kw)
    return Engine(EngineConfig(**settings))


def stream_all(engine, prompts, params):
    """Every request streamed: (final outputs, the tokens each stream delivered)."""
    streams = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    streamed, finals = [], []
    for s in streams:
        tokens = []
        for out in s:
            tokens += out.delta_token_ids
            if out.finished:
                finals.append(out)
        streamed.append(tokens)
    return finals, streamed


def greedy(n, **kw):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def generate_in_steady_runs(path, async_pipeline, prompts, lengths, **kw):
    """Greedy outputs of prompts (lengths new tokens each) from a fresh engine that took steady steps."""
    engine = make_engine(path, async_pipeline, **kw)
    try:
        outs = engine.generate(prompts, [greedy(n) for n in lengths])
        assert engine.stats()["steady_steps"] > 0
        return outs
    finally:
        engine.shutdown()


@pytest.mark.parametrize("async_pipeline", MODES)
def test_steady_runs_equal_transformers_and_hash_their_output_blocks(root, async_pipeline):
    """Requests finish at different steps, so steady runs end and start again; every KV block a run writes
    (block_size 4: a new block every fourth step) must be addressed right for the tokens to match. Output blocks
    filled during a run are hashed: a later prompt that repeats a request's output finds them cached."""
    path = build_tiny("llama", root)
    prompts = random_prompts([9, 14, 3, 21, 9, 6], seed=51)
    lengths = [40, 25, 33, 40, 12, 29]
    want = [hf_greedy(path, p, n) for p, n in zip(prompts, lengths)]
    engine = make_engine(path, async_pipeline)
    try:
        outs = engine.generate(prompts, [greedy(n) for n in lengths])
        assert [o.token_ids for o in outs] == want
        # the stats are the loop's snapshot after each step: the last outputs may arrive before it is taken
        assert kv_blocks_used_after_settling(engine) == 0
        # every step after the prefill and the first decode step: finishing requests leave the run as rows
        steady_steps = engine.scheduler.num_steady_steps
        assert steady_steps == engine.stats()["steps"] - 2 == 40 - 2
        assert engine.stats()["steady_steps"] == steady_steps

        follow_up = prompts[3] + want[3][:30]  # 51 tokens: 12 full blocks, 7 of them written in steady steps
        again = engine.generate([follow_up], greedy(8))[0]
        assert again.num_cached_tokens == (len(follow_up) - 1) // 4 * 4
        assert again.token_ids == hf_greedy(path, follow_up, 8)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("async_pipeline", MODES)
def test_queued_requests_join_a_steady_run(root, async_pipeline):
    """Three seats for seven requests: each finish admits a waiting request, which prefills beside the steady rows
    (with chunked prefill: budget 6 tokens) and then becomes a row. Outputs equal transformers'; after the first
    two steps every step is a steady one."""
    path = build_tiny("qwen3", root)
    prompts = random_prompts([9, 4, 13, 7, 2, 11, 6], seed=57)
    lengths = [14, 22, 9, 17, 12, 6, 19]
    want = [hf_greedy(path, p, n) for p, n in zip(prompts, lengths)]
    engine = make_engine(path, async_pipeline, max_num_seqs=3, max_num_batched_tokens=6)
    try:
        outs = engine.generate(prompts, [greedy(n) for n in lengths])
        assert [o.token_ids for o in outs] == want
        stats = engine.stats()
        assert stats["steady_steps"] >= stats["steps"] - 6  # prefill of the first three: 9 + 4 + 13 tokens
        assert kv_blocks_used_after_settling(engine) == 0
    finally:
        engine.shutdown()


def _run_mixed(path, async_pipeline, steady):
    """Sampling, stop tokens, min_tokens and streaming in one batch; returns (finals, streamed tokens, steps)."""
    prompts = random_prompts([7, 12, 5, 16, 9, 10], seed=61)
    free_run = hf_greedy(path, prompts[1], 30)
    # a token first sampled well after the prompt, so it arrives inside a steady run
    stop_tok = next(t for i, t in enumerate(free_run) if i >= 8 and t not in free_run[:i])
    params = [
        SamplingParams(max_tokens=30, temperature=0.8, top_k=20, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=[stop_tok], ignore_eos=True),
        SamplingParams(max_tokens=30, temperature=0.0, min_tokens=20, stop_token_ids=[stop_tok], ignore_eos=True),
        greedy(30, repetition_penalty=1.3),
        greedy(30, frequency_penalty=2.0),  # strong: a token left out of its counts changes the next pick
        greedy(26),
    ]
    engine = make_engine(path, async_pipeline, steady=steady, max_num_seqs=3)  # two of them join later
    try:
        finals, streamed = stream_all(engine, prompts, params)
        return finals, streamed, engine.scheduler.num_steady_steps
    finally:
        engine.shutdown()


@pytest.mark.parametrize("async_pipeline", MODES)
def test_steady_runs_match_the_general_path(root, async_pipeline):
    path = build_tiny("llama", root)
    on, on_streamed, on_steps = _run_mixed(path, async_pipeline, steady=True)
    off, off_streamed, off_steps = _run_mixed(path, async_pipeline, steady=False)
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert [o.finish_reason for o in on] == [o.finish_reason for o in off]
    assert on[1].finish_reason == "stop" and len(on[1].token_ids) >= 9 and on[5].finish_reason == "length"
    assert on_streamed == [o.token_ids for o in on] and off_streamed == [o.token_ids for o in off]
    assert on_steps > 0 and off_steps == 0


def _run_sampled(path, async_pipeline, steady, monkeypatch):
    """Eight seeded requests, each sampling with its own settings, four seats: rows finish and joiners take their
    place. Returns (tokens of each, steps, the rows read by each call that read sampling settings from requests)."""
    from backend.executor import packer, steady_sampling

    calls = []
    for module, name in ((packer, "fill_request_rows"), (steady_sampling, "request_columns")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _real=real: calls.append(len(a[0])) or _real(*a))
    prompts = random_prompts([7, 12, 5, 16, 9, 4, 11, 8], seed=63)
    settings = [dict(temperature=0.8, top_k=20), dict(temperature=1.0, top_p=0.9), dict(temperature=0.7, min_p=0.1),
                dict(temperature=1.2, top_k=5, top_p=0.8), dict(temperature=0.0), dict(temperature=0.9),
                dict(temperature=0.6, top_p=0.5), dict(temperature=1.0, top_k=3)]
    lengths = [30, 18, 25, 40, 12, 22, 35, 16]
    params = [SamplingParams(max_tokens=n, seed=100 + i, ignore_eos=True, **kw)
              for i, (n, kw) in enumerate(zip(lengths, settings))]
    engine = make_engine(path, async_pipeline, steady=steady, max_num_seqs=4)
    try:
        outs = engine.generate(prompts, params)
        assert [len(o.token_ids) for o in outs] == lengths
        return [o.token_ids for o in outs], engine.stats()["steps"], list(calls)  # a copy: a later run adds on
    finally:
        engine.shutdown()


@pytest.mark.parametrize("async_pipeline", MODES)
def test_steady_rows_keep_their_sampling_settings_between_row_changes(root, async_pipeline, monkeypatch):
    """The steady rows' sampling settings are read from each request a few times in its life, not once a step: kept
    per row while the rows stay the same (each row's step index then moves with its token count), and following
    the rows as they leave and join (only a joiner's own settings are read). The seeded draws are the general
    path's, token for token."""
    path = build_tiny("llama", root)
    on, steps, reads_on = _run_sampled(path, async_pipeline, True, monkeypatch)
    off, _, reads_off = _run_sampled(path, async_pipeline, False, monkeypatch)
    assert on == off
    assert len(reads_off) >= steps - 1  # the general path reads every sampled row's settings every step
    assert sum(reads_off) > 150
    assert len(reads_on) < steps // 4
    assert sum(reads_on) <= 3 * len(on)  # eight requests: at most three reads of each one's settings


@pytest.mark.parametrize("async_pipeline", MODES)
def test_abort_inside_a_steady_run_returns_every_block(root, async_pipeline):
    """The aborted request leaves the run as a deleted row; the others go on in steady steps, unchanged."""
    path = build_tiny("llama", root)
    prompts = random_prompts([5, 8, 11], seed=71)
    want = [hf_greedy(path, prompts[i], 200) for i in (0, 2)]
    engine = make_engine(path, async_pipeline)
    try:
        streams = [engine.add_request(p, greedy(200), request_id=f"r{i}") for i, p in enumerate(prompts)]
        for out in streams[1]:
            if len(out.token_ids) >= 12:
                break
        assert engine.scheduler.num_steady_steps > 0
        steady_before = engine.scheduler.num_steady_steps
        engine.abort("r1")
        victim = streams[1].result()
        rest = [streams[0].result(), streams[2].result()]
        assert victim.finish_reason == "abort" and 12 <= len(victim.token_ids) < 200
        assert [o.token_ids for o in rest] == want
        assert engine.scheduler.num_steady_steps - steady_before > 150  # the run went on without the aborted row
        assert kv_blocks_used_after_settling(engine) == 0
    finally:
        engine.shutdown()


@pytest.mark.parametrize("async_pipeline", MODES)
def test_rows_that_may_end_take_the_general_rules_inside_a_steady_step(root, async_pipeline, monkeypatch):
    """16 rows of spread lengths, two with a stop token: steps where a few rows near their limit or sample a stop
    token update only those rows by the general rules and the rest as steady rows, also when rows left the run
    after the step was packed (its rows as packed); tokens, finish reasons, streamed tokens and freed blocks equal
    the general path's."""
    from backend.core.step_update import StepUpdater

    path = build_tiny("llama", root)
    prompts = random_prompts([5 + (i * 7) % 13 for i in range(16)], seed=81)
    stop_tok = hf_greedy(path, prompts[3], 20)[11]
    params = [greedy(12 + (i * 5) % 23) for i in range(16)]
    params[3] = greedy(30, stop_token_ids=[stop_tok])
    params[9] = SamplingParams(max_tokens=30, temperature=0.9, seed=4, stop_token_ids=[stop_tok], ignore_eos=True)
    risky_steps = []
    original = StepUpdater._update_steady

    def spy(self, st, result):
        out = original(self, st, result)
        if out is not None and out[1]:
            risky_steps.append(len(out[1]))
        return out

    monkeypatch.setattr(StepUpdater, "_update_steady", spy)
    packed_updates = []  # steps updated from their rows as packed (rows had left or joined since)
    original_packed = StepUpdater._update_packed_rows

    def spy_packed(self, st, result, packed):
        out = original_packed(self, st, result, packed)
        packed_updates.append(out is not None)
        return out

    monkeypatch.setattr(StepUpdater, "_update_packed_rows", spy_packed)

    def run(steady):
        engine = make_engine(path, async_pipeline, steady=steady)
        try:
            finals, streamed = stream_all(engine, prompts, params)
            return finals, streamed, kv_blocks_used_after_settling(engine)
        finally:
            engine.shutdown()

    on, on_streamed, on_blocks = run(True)
    assert risky_steps and max(risky_steps) <= 4  # the hybrid update ran, with at most a quarter of the rows
    assert any(packed_updates) == async_pipeline  # only a queued step sees rows change before its update
    off, off_streamed, off_blocks = run(False)
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert [o.finish_reason for o in on] == [o.finish_reason for o in off]
    assert on[3].finish_reason == "stop" and len(on[3].token_ids) == 12
    assert on_streamed == [o.token_ids for o in on] and off_streamed == [o.token_ids for o in off]
    assert on_blocks == off_blocks == 0


def test_steady_sampling_rows_follow_rows_leaving_and_joining():
    """After rows leave and join, the kept settings equal a fresh read of every row, with only the joiners read."""
    import numpy as np

    from backend.core.steady_batch import SteadyBatch
    from backend.executor import sampler, steady_sampling
    from backend.request import Request

    def request(i):
        params = SamplingParams(max_tokens=50, temperature=0.5 + 0.1 * i, top_p=0.9 if i % 2 else 1.0,
                                top_k=i % 3 * 10, seed=i)
        req = Request(f"r{i}", [3] * (4 + i), params, seed=1000 + i, eos_token_ids=frozenset({2}))
        req.num_computed_tokens = req.num_prompt_tokens + i
        req.block_ids = [2 * i + 1, 2 * i + 2][:-(-req.num_computed_tokens // 16)]  # blocks cover its tokens
        req.num_tokens = req.num_prompt_tokens + i + 1  # i + 1 output tokens
        return req

    def arrays(n):
        return np.zeros((6, n), np.float32), np.zeros((2, n), np.int64), np.zeros(n, np.int32)

    sb = SteadyBatch([request(i) for i in range(6)], block_size=16, max_model_len=256, max_blocks=8)
    kept = steady_sampling.SteadySamplingRows()
    kept.fill(sb, *arrays(6))
    sb.advance(1)  # every row's step index moves by one
    sb._delete(np.array([1, 4]))
    sb._append([request(6), request(7)], np.array([0, 1]))
    sb._delete(np.array([0]))
    reads = []
    real = steady_sampling.request_columns
    steady_sampling.request_columns = lambda *a: reads.append(len(a[0])) or real(*a)
    try:
        got = arrays(len(sb))
        flags = kept.fill(sb, *got)
    finally:
        steady_sampling.request_columns = real
    assert reads == [2]  # the two joiners only
    sb.sync_rows()  # the rows' requests read their counts from the batch (advance counts in the batch only)
    want = arrays(len(sb))
    want_flags = sampler.fill_host_rows([r.params for r in sb.requests], [r.seed for r in sb.requests],
                                        [r.num_output_tokens - 1 for r in sb.requests], *want)
    assert [r.request_id for r in sb.requests] == ["r7", "r5", "r2", "r3", "r6"]  # each hole taken by the last row
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    assert flags == want_flags


def test_plain_greedy_steady_rows_sample_as_neutral_greedy_rows_without_reading_a_request():
    """Plain-greedy rows all sample the argmax, whatever their seeds or cutoffs: their host rows are the neutral
    greedy rows (as padding rows), their flags all-greedy, and no request's settings are read, however the rows
    changed; the first sampled joiner brings every row's own settings back."""
    import numpy as np

    from backend.core.steady_batch import SteadyBatch
    from backend.executor import sampler, steady_sampling
    from backend.request import Request

    def request(i, **kw):
        req = Request(f"r{i}", [3] * (4 + i), SamplingParams(max_tokens=50, seed=i, **kw), seed=1000 + i,
                      eos_token_ids=frozenset({2}))
        req.num_computed_tokens = req.num_prompt_tokens + i
        req.block_ids = [2 * i + 1, 2 * i + 2][:-(-req.num_computed_tokens // 16)]  # blocks cover its tokens
        req.num_tokens = req.num_prompt_tokens + i + 1
        return req

    def arrays(n, fill=7):
        return np.full((6, n), fill, np.float32), np.full((2, n), fill, np.int64), np.full(n, fill, np.int32)

    greedy_kw = [dict(temperature=0.0), dict(temperature=0.0, top_k=5, top_p=0.5, min_p=0.1)]
    sb = SteadyBatch([request(i, **greedy_kw[i % 2]) for i in range(5)], block_size=16, max_model_len=256,
                     max_blocks=8)
    assert sb.all_plain_greedy
    kept = steady_sampling.SteadySamplingRows()
    reads = []
    real = steady_sampling.request_columns
    steady_sampling.request_columns = lambda *a: reads.append(len(a[0])) or real(*a)
    try:
        for change in (None, "delete", "append"):
            if change == "delete":
                sb._delete(np.array([1, 3]))
            elif change == "append":
                sb._append([request(8, **greedy_kw[1])], np.array([0]))
            got = arrays(len(sb))
            flags = kept.fill(sb, *got)
            want = arrays(len(sb), fill=3)
            sampler.fill_padding_rows(*want)
            for g, w in zip(got, want):
                np.testing.assert_array_equal(g, w)
            assert flags == sampler.row_flags(want[0], want[2], -1) and flags["all_greedy"]
        assert reads == []
        sb._append([request(9, temperature=0.8, top_k=20)], np.array([1]))
        assert not sb.all_plain_greedy
        got = arrays(len(sb))
        flags = kept.fill(sb, *got)
    finally:
        steady_sampling.request_columns = real
    assert reads == [len(sb)]  # every row's own settings, read once
    want = arrays(len(sb))
    want_flags = sampler.fill_host_rows([r.params for r in sb.requests], [r.seed for r in sb.requests],
                                        [r.num_output_tokens - 1 for r in sb.requests], *want)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    assert flags == want_flags and flags["any_top_k"] and not flags["all_greedy"]


def test_plain_greedy_rows_of_a_step_are_packed_as_neutral_greedy_rows_without_reading_their_settings():
    """A step whose sampled requests are all plain greedy (whatever their cutoffs and seeds) writes the neutral
    greedy rows and all-greedy flags without reading a request's settings; one sampled request among them brings
    every row's own settings back, as fill_host_rows writes them."""
    import numpy as np
    import torch

    from backend.core.scheduler import ScheduledBatch
    from backend.executor import packer as packer_module
    from backend.executor import sampler
    from backend.executor.packer import SlotPacker
    from backend.step_records import StepState
    from backend.executor.pipeline import Pipeline, SlotLayout
    from backend.request import Request
    from backend.runtime.timeline import Timeline

    def request(i, **kw):
        req = Request(f"r{i}", [3] * (4 + i), SamplingParams(max_tokens=50, seed=i, **kw), seed=1000 + i,
                      eos_token_ids=frozenset({2}))
        req.num_tokens = req.num_prompt_tokens + i + 1  # i + 1 outputs, the last one pending
        return req

    layout = SlotLayout(max_tokens=16, max_seqs=8, max_blocks=2, max_logprobs=2)
    pipe = Pipeline(layout, torch.device("cpu"), Timeline())
    packer = SlotPacker(pipe, layout, block_size=16, device=torch.device("cpu"))
    reads = []
    real = packer_module.fill_request_rows
    packer_module.fill_request_rows = lambda reqs, *a: reads.append(len(reqs)) or real(reqs, *a)
    try:
        greedy_reqs = [request(0, temperature=0.0), request(1, temperature=0.0, top_k=5, top_p=0.5, min_p=0.1)]
        for reqs, read in ((greedy_reqs, False), ([*greedy_reqs, request(2, temperature=0.8, top_k=20)], True)):
            del reads[:]
            slot = pipe.acquire_slot()
            host_f, host_i, host_k = slot.sampling_host
            host_f[:], host_i[:], host_k[:] = 7, 7, 7  # what an earlier step left
            st = StepState(ScheduledBatch(0, requests=list(reqs)), slot, sampled=list(reqs))
            tensors = packer.sampling_rows(st, rows=4)
            n = len(reqs)
            want = np.zeros((6, 4), np.float32), np.zeros((2, 4), np.int64), np.zeros(4, np.int32)
            assert reads == ([len(reqs)] if read else [])  # every row's settings read, or none
            if read:
                want_flags = sampler.fill_host_rows([r.params for r in reqs], [r.seed for r in reqs],
                                                    [r.num_tokens - r.num_prompt_tokens - 1 for r in reqs],
                                                    want[0][:, :n], want[1][:, :n], want[2][:n])
            else:
                sampler.fill_padding_rows(want[0][:, :n], want[1][:, :n], want[2][:n])
                want_flags = sampler.row_flags(want[0][:, :n], want[2][:n], -1)
            sampler.fill_padding_rows(want[0][:, n:], want[1][:, n:], want[2][n:])
            for got, w in zip((host_f[:, :4], host_i[:, :4], host_k[:4]), want):
                np.testing.assert_array_equal(got, w)
            assert tensors.all_greedy == want_flags["all_greedy"] == (not read)
            assert tensors.any_top_k == want_flags["any_top_k"] == read
    finally:
        packer_module.fill_request_rows = real


def test_rows_count_their_tokens_in_the_batch_and_their_requests_catch_up_when_synced_or_leaving():
    """advance counts in the batch only: a row's request keeps its counts until it is synced, and then they are what
    counting every step on the request would have given; a row that leaves, and every row when the batch is
    released, takes its counts and newest step back; a request that is no row is left alone."""
    import numpy as np

    from backend.core.steady_batch import SteadyBatch
    from backend.request import Request

    def request(i):
        req = Request(f"r{i}", [3] * (4 + i), SamplingParams(max_tokens=50), seed=i, eos_token_ids=frozenset({2}))
        req.num_computed_tokens = req.num_prompt_tokens + i  # i outputs fed, the next one pending
        req.num_tokens = req.num_computed_tokens + 1
        req.block_ids = [2 * i + 1, 2 * i + 2]
        return req

    def counts(req):
        return req.num_computed_tokens, req.num_tokens, req.last_step_id

    reqs = [request(i) for i in range(4)]
    start = [counts(r) for r in reqs]
    sb = SteadyBatch(reqs, block_size=16, max_model_len=256, max_blocks=8)
    sb.advance(10)
    sb.advance(11)
    assert [counts(r) for r in reqs] == start  # the requests are not walked
    assert sb.computed.tolist() == [c + 2 for c, _, _ in start]
    sb.sync(reqs[0])
    assert counts(reqs[0]) == (start[0][0] + 2, start[0][1] + 2, 11)
    assert counts(reqs[2]) == start[2]
    sb._delete(np.array([1]))  # r1 leaves: it takes its counts back, and the batch forgets it
    assert counts(reqs[1]) == (start[1][0] + 2, start[1][1] + 2, 11)
    joiner = request(7)
    sb._append([joiner], np.array([0]))
    sb.advance(12)
    sb.sync(joiner)  # counted from when it joined: one step
    assert counts(joiner) == (joiner.num_prompt_tokens + 8, joiner.num_prompt_tokens + 9, 12)
    reqs[1].num_computed_tokens = -5  # no row any more: sync leaves it alone
    sb.sync(reqs[1])
    assert reqs[1].num_computed_tokens == -5
    sb.release_rows()
    assert [counts(r) for r in (reqs[0], reqs[2], reqs[3])] == [(c + 3, t + 3, 12) for c, t, _ in
                                                                 (start[0], start[2], start[3])]
    assert sb.computed.tolist() == [r.num_computed_tokens for r in sb.requests]
    sb.advance(13)  # a released batch's rows are the scheduler's again: syncing changes nothing
    sb.sync_rows()
    assert counts(reqs[0]) == (start[0][0] + 3, start[0][1] + 3, 12)


@pytest.mark.parametrize("async_pipeline", MODES)
def test_the_general_update_sees_the_counts_the_steady_batch_keeps(root, async_pipeline, monkeypatch):
    """Requests the general update looks at (risky rows, joiners that became rows since their step was scheduled)
    hold the token counts the steady batch keeps for them, though advance counts in the batch only."""
    from backend.core.step_update import StepUpdater

    real, checked = StepUpdater._update_rows, [0]

    def update_rows(self, result, rows, next_state, events, finish):
        sb = self.scheduler.steady
        if sb is not None:
            where = {id(r): row for row, r in enumerate(sb.requests)}
            for i in rows:
                req, row = result.requests[i], where.get(id(result.requests[i]))
                if row is not None:
                    assert (req.num_computed_tokens, req.num_tokens) == (sb.computed[row], sb.computed[row] + 1)
                    checked[0] += 1
        real(self, result, rows, next_state, events, finish)

    monkeypatch.setattr(StepUpdater, "_update_rows", update_rows)
    path = build_tiny("llama", root)
    prompts = random_prompts([5, 11, 3, 8, 14, 6, 9, 4], seed=17)
    lengths = [19, 7, 26, 12, 9, 23, 15, 30]
    outs = generate_in_steady_runs(path, async_pipeline, prompts, lengths, max_num_seqs=3)
    assert [o.token_ids for o in outs] == [hf_greedy(path, p, n) for p, n in zip(prompts, lengths)]
    assert checked[0] > 0


@pytest.mark.parametrize("async_pipeline", MODES)
def test_steady_rows_that_run_out_of_kv_blocks_take_them_one_by_one_and_equal_transformers(
        root, async_pipeline, monkeypatch):
    """Too few free blocks for every steady row that needs one: the rows take blocks one at a time by their token
    counts (the batch's, the requests' own having fallen behind), then the general path preempts; tokens stay
    transformers' and every block comes back."""
    from backend.core.kv_cache import BlockManager

    real, short = BlockManager.append_one_block_each, [0]

    def append_one_block_each(self, reqs):
        blocks = real(self, reqs)
        short[0] += blocks is None
        return blocks

    monkeypatch.setattr(BlockManager, "append_one_block_each", append_one_block_each)
    path = build_tiny("llama", root)
    prompts = random_prompts([6, 9, 5, 7], seed=53)
    lengths = [40, 36, 44, 38]
    engine = make_engine(path, async_pipeline, num_kv_blocks=36, max_num_seqs=4)
    try:
        outs = engine.generate(prompts, [greedy(n) for n in lengths])
        stats = engine.stats()
        assert stats["steady_steps"] > 0 and stats["preemptions"] > 0
        assert kv_blocks_used_after_settling(engine) == 0
    finally:
        engine.shutdown()
    assert [o.token_ids for o in outs] == [hf_greedy(path, p, n) for p, n in zip(prompts, lengths)]
    assert short[0] > 0


def test_rows_gone_since_follows_deletes_and_appends():
    """Which of a version's rows left since: deletes (the last row moving into each hole) compose, appends keep the
    old rows' indices, and a change that is no longer recorded gives None."""
    import numpy as np

    from backend.core.steady_batch import SteadyBatch
    from backend.request import Request

    def request(i):
        req = Request(f"r{i}", [3] * 4, SamplingParams(max_tokens=50), seed=i, eos_token_ids=frozenset({2}))
        req.num_computed_tokens, req.block_ids = 4, [i + 1]
        return req

    sb = SteadyBatch([request(i) for i in range(6)], block_size=16, max_model_len=256, max_blocks=8)
    assert sb.rows_gone_since(0, 6) == []
    sb._delete(np.array([1, 4]))  # each hole taken by the last row: r0 r5 r2 r3
    assert [r.request_id for r in sb.requests] == ["r0", "r5", "r2", "r3"]
    sb._append([request(6)], np.array([0]))  # r0 r5 r2 r3 r6
    assert sb.rows_gone_since(0, 6) == [1, 4] and sb.rows_gone_since(1, 4) == []
    sb._delete(np.array([0, 3]))  # r6 r5 r2
    assert [r.request_id for r in sb.requests] == ["r6", "r5", "r2"]
    assert sb.rows_gone_since(0, 6) == [0, 1, 3, 4]
    assert sb.rows_gone_since(1, 4) == [0, 3]
    assert sb.rows_gone_since(2, 5) == [0, 3]
    for _ in range(8):  # more changes than are kept
        sb._append([request(7)], np.array([0]))
    assert sb.rows_gone_since(0, 6) is None


def test_block_tables_follow_rows_leaving_joining_and_growing():
    """The rows' block tables stay each row's blocks in row order through deletes (their store rows reused by later
    joiners), appends, blocks added, and the store growing past its first size."""
    import random

    import numpy as np

    from backend.core.steady_batch import SteadyBatch
    from backend.request import Request

    rng = random.Random(7)
    made = iter(range(10_000))

    def request():
        i = next(made)
        req = Request(f"r{i}", [3] * 4, SamplingParams(max_tokens=500), seed=i, eos_token_ids=frozenset({2}))
        req.num_computed_tokens = 4
        req.block_ids = [rng.randrange(1, 1000) for _ in range(rng.randint(1, 12))]
        return req

    sb = SteadyBatch([request() for _ in range(5)], block_size=16, max_model_len=256, max_blocks=16)
    first_size = len(sb.table_store)
    for _ in range(200):
        move = rng.random()
        if move < 0.3 and len(sb) > 1:
            sb._delete(np.array(sorted(rng.sample(range(len(sb)), rng.randint(1, min(3, len(sb) - 1))))))
        elif move < 0.6:
            joiners = [request() for _ in range(rng.randint(1, 6))]
            sb._append(joiners, np.zeros(len(joiners), dtype=np.int64))
        else:
            row = rng.randrange(len(sb))
            req = sb.requests[row]
            if len(req.block_ids) < 16:
                req.block_ids.append(rng.randrange(1, 1000))
                sb.add_block(row, req.block_ids[-1])
        assert sb.tables.shape == (len(sb), 16)
        for row, req in enumerate(sb.requests):
            assert sb.num_blocks[row] == len(req.block_ids)
            assert sb.tables[row, :len(req.block_ids)].tolist() == req.block_ids
    assert len(sb.table_store) > first_size  # the store grew at least once


def _run_with_edits(path, async_pipeline, steady):
    """Ten requests on three seats, some of them with logit_bias, bad_words or min_tokens beside plain
    greedy and seeded sampled ones: rows with logit edits inside steady runs that rows leave and join."""
    prompts = random_prompts([6, 11, 4, 9, 13, 5, 8, 10, 7, 12], seed=91)
    free_run = hf_greedy(path, prompts[0], 24)
    # request 4 may stop from its output token `edge` on, and its free run samples its stop token there: the ban
    # must lift at exactly that step (it reads the request's output count), or the request runs on
    edge_run = hf_greedy(path, prompts[4], 24)
    edge = next(i for i, t in enumerate(edge_run) if i >= 8 and t not in edge_run[:i])
    params = [
        greedy(24, logit_bias={str(free_run[5]): -100.0}),
        greedy(18),
        SamplingParams(max_tokens=20, temperature=0.9, seed=3, ignore_eos=True),
        greedy(22, bad_words=[" a"]),
        greedy(24, min_tokens=edge, stop_token_ids=[edge_run[edge]]),
        SamplingParams(max_tokens=25, temperature=0.7, top_p=0.9, seed=5, ignore_eos=True),
        greedy(14),
        greedy(21, logit_bias={str(free_run[1]): 5.0}),
        SamplingParams(max_tokens=19, temperature=1.1, top_k=8, seed=9, ignore_eos=True),
        greedy(17, stop_token_ids=[free_run[3]]),
    ]
    engine = make_engine(path, async_pipeline, steady=steady, max_num_seqs=3)
    try:
        finals, streamed = stream_all(engine, prompts, params)
        return finals, streamed, engine.scheduler.num_steady_steps, kv_blocks_used_after_settling(engine)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("async_pipeline", MODES)
def test_steady_rows_with_logit_edits_match_the_general_path(root, async_pipeline):
    path = build_tiny("llama", root)
    on, on_streamed, on_steps, on_blocks = _run_with_edits(path, async_pipeline, steady=True)
    off, off_streamed, off_steps, off_blocks = _run_with_edits(path, async_pipeline, steady=False)
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert [o.finish_reason for o in on] == [o.finish_reason for o in off]
    assert on_streamed == [o.token_ids for o in on] and off_streamed == [o.token_ids for o in off]
    assert on_steps > 20 and off_steps == 0
    assert on_blocks == off_blocks == 0
    assert on[4].finish_reason == "stop" and len(on[4].token_ids) == on[4].token_ids.index(on[4].token_ids[-1]) + 1


@pytest.mark.parametrize("async_pipeline", MODES)
def test_each_steady_pack_writes_every_rows_kv_slot_and_block_table_as_its_request_holds_them(
        root, async_pipeline, monkeypatch):
    """The steady rows' KV slots are kept as arrays (one more each step, a new block's first slot when one starts)
    and their block tables written whole only for the rows that moved since the slot's last pack (a row taking a
    deleted one's place, a joiner): after every steady pack each row's slot and table are what its request's blocks
    give."""
    from backend.executor.packer import SlotPacker

    checked, incremental, some_moved = [0], [0], [0]
    real_pack, real_tables = SlotPacker._pack_steady, SlotPacker._write_steady_tables

    def tables(slot, sb):
        held = slot.steady_tables
        if held is not None and held[0] == sb.serial:
            incremental[0] += 1
            moved = int((held[1][:len(sb)] != sb.table_ids).sum())
            some_moved[0] += 0 < moved <= len(sb) // 2
        real_tables(slot, sb)

    def pack(self, st, prev):
        real_pack(self, st, prev)
        h, bs = st.slot.np, self.block_size
        for i, req in enumerate(st.batch.steady.requests):
            st.batch.steady.sync(req)  # the batch counts its rows' tokens; the request's own counts catch up
            pos = req.num_computed_tokens - 1
            assert h["positions"][i] == pos
            assert h["slot_mapping"][i] == req.block_ids[pos // bs] * bs + pos % bs
            assert h["block_tables"][i, :len(req.block_ids)].tolist() == req.block_ids
            assert h["query_start_loc"][i + 1] == i + 1 and h["logits_idx"][i] == i
        checked[0] += 1

    monkeypatch.setattr(SlotPacker, "_pack_steady", pack)
    monkeypatch.setattr(SlotPacker, "_write_steady_tables", staticmethod(tables))
    path = build_tiny("llama", root)
    prompts = random_prompts([3, 9, 4, 14, 6, 11, 5, 8, 13, 7], seed=29)
    lengths = [21, 9, 30, 14, 26, 7, 18, 33, 11, 24]
    engine = make_engine(path, async_pipeline, max_num_seqs=5)
    try:
        outs = engine.generate(prompts, [greedy(n) for n in lengths])
    finally:
        engine.shutdown()
    assert [o.token_ids for o in outs] == [hf_greedy(path, p, n) for p, n in zip(prompts, lengths)]
    assert checked[0] > 30 and 0 < incremental[0] < checked[0] and some_moved[0] > 0


@pytest.mark.parametrize("async_pipeline", MODES)
def test_a_finishing_request_knows_the_newest_step_that_holds_it_and_its_pending_count_follows_its_tokens(
        root, async_pipeline, monkeypatch):
    """Steady rows do not count their steps one by one: the batch does, and a request that leaves the rows takes
    the count back. Whenever a request finishes, its newest step is the newest scheduled step holding it (a step
    still queued then frees its blocks only after it ran), and its pending tokens are its count less its lists."""
    from backend.core.scheduler import Scheduler
    from backend.core.step_update import StepUpdater

    newest: dict[int, int] = {}
    real_schedule, real_finish = Scheduler.schedule, StepUpdater.finish
    finished = []

    def schedule(self):
        batch = real_schedule(self)
        if batch is not None:
            for req in batch.requests:
                newest[id(req)] = batch.step_id
        return batch

    def finish(self, req, reason, next_state):
        was_finished = req.is_finished
        real_finish(self, req, reason, next_state)
        if not was_finished:
            assert req.last_step_id == newest[id(req)]
            assert req.num_pending == req.num_tokens - req.num_prompt_tokens - len(req.output_token_ids) >= 0
            finished.append(req)

    monkeypatch.setattr(Scheduler, "schedule", schedule)
    monkeypatch.setattr(StepUpdater, "finish", finish)
    path = build_tiny("llama", root)
    prompts = random_prompts([6, 3, 12, 5, 9, 4, 15, 7], seed=41)
    lengths = [17, 28, 9, 22, 13, 31, 6, 19]
    outs = generate_in_steady_runs(path, async_pipeline, prompts, lengths, max_num_seqs=4)
    assert [len(o.token_ids) for o in outs] == lengths and len(finished) == len(prompts)
