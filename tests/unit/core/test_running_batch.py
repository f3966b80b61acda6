"""The running batch (backend/core/running_batch.py): every running request's decode rows, kept in arrays, give
exactly transformers' tokens (greedy) and each seeded request's own draws whatever batch it runs in; rows leave and
join as requests finish, are aborted, preempted or admitted, and every count, block table and setting kept per row
follows them."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from backend import Engine, SamplingParams
from tests.sampling_helpers import fill_host_rows
from tests.tiny_models import build_tiny, hf_greedy, hf_model, kv_blocks_used_after_settling, random_prompts, \
    tiny_engine, word_tokenizer

MODES = [pytest.param(False, id="sync"), pytest.param(True, id="async")]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tiny-rows"))


def make_engine(path, async_pipeline, **kw) -> Engine:
    return tiny_engine(path, async_pipeline, **{"num_kv_blocks": 400, "max_num_batched_tokens": 64, **kw})


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


def generate_as_rows(path, async_pipeline, prompts, lengths, **kw):
    """Greedy outputs of prompts (lengths new tokens each) from a fresh engine whose requests decoded as rows."""
    engine = make_engine(path, async_pipeline, **kw)
    try:
        outs = engine.generate(prompts, [greedy(n) for n in lengths])
        assert engine.scheduler.batch.advances > 0
        return outs
    finally:
        engine.shutdown()


def run_alone(path, async_pipeline, prompts, params):
    """Each request alone in its batch: a fresh engine with one seat runs them one after another."""
    engine = make_engine(path, async_pipeline, max_num_seqs=1)
    try:
        return engine.generate(prompts, params)
    finally:
        engine.shutdown()


class _FrequencyPenalty(LogitsProcessor):
    """The engine's frequency penalty for transformers: each output token's count times the penalty off its logit."""

    def __init__(self, prompt_len: int, penalty: float) -> None:
        self.prompt_len, self.penalty = prompt_len, penalty

    def __call__(self, input_ids, scores):
        counts = torch.bincount(input_ids[0, self.prompt_len:], minlength=scores.shape[-1])
        return scores - self.penalty * counts.to(scores.dtype)


def hf_reference(path, prompt, sp) -> tuple[list[int], str]:
    """transformers' greedy output for a greedy request's settings, and the finish reason it gives: stop tokens as
    eos, min_tokens, repetition and frequency penalties, logit_bias and bad_words as transformers' processors."""
    assert sp.greedy and sp.ignore_eos
    kw = {}
    if sp.min_tokens:
        kw["min_new_tokens"] = sp.min_tokens
    if sp.repetition_penalty != 1.0:
        kw["repetition_penalty"] = sp.repetition_penalty
    if sp.frequency_penalty:
        kw["logits_processor"] = LogitsProcessorList([_FrequencyPenalty(len(prompt), sp.frequency_penalty)])
    if sp.logit_bias:
        kw["sequence_bias"] = {(tok,): bias for tok, bias in sp.logit_bias.items()}
    if sp.bad_words:  # a single token each with the word tokenizer ("a" and " a" alike: the unknown token)
        kw["bad_words_ids"] = [word_tokenizer().encode(w.strip(), add_special_tokens=False) for w in sp.bad_words]
    stops = list(sp.stop_token_ids)
    tokens = hf_greedy(path, prompt, sp.max_tokens, eos=stops or None, **kw)
    stopped = bool(tokens) and tokens[-1] in stops and len(tokens) > sp.min_tokens
    return tokens, "stop" if stopped else "length"


def references(path, async_pipeline, prompts, params) -> tuple[list[list[int]], list[str]]:
    """Each request's tokens and finish reason from an independent run: transformers for greedy requests, the
    request alone in a one-seat engine for sampled ones (seeded draws do not depend on the batch)."""
    tokens, reasons = [None] * len(prompts), [None] * len(prompts)
    sampled = [i for i, sp in enumerate(params) if not sp.greedy]
    for i, out in zip(sampled, run_alone(path, async_pipeline, [prompts[i] for i in sampled],
                                         [params[i] for i in sampled])):
        tokens[i], reasons[i] = out.token_ids, out.finish_reason
    for i, sp in enumerate(params):
        if sp.greedy:
            tokens[i], reasons[i] = hf_reference(path, prompts[i], sp)
    return tokens, reasons


def spy_appended(monkeypatch) -> list[str]:
    """The request ids of every request that becomes a decode row (RunningBatch._append), in order."""
    from backend.core.running_batch import RunningBatch

    appended, real = [], RunningBatch._append

    def append(self, reqs, src_rows):
        appended.extend(r.request_id for r in reqs)
        return real(self, reqs, src_rows)

    monkeypatch.setattr(RunningBatch, "_append", append)
    return appended


@pytest.mark.parametrize("async_pipeline", MODES)
def test_decode_rows_equal_transformers_and_hash_their_output_blocks(root, async_pipeline):
    """Requests finish at different steps, so rows leave the running batch; every KV block a row writes
    (block_size 4: a new block every fourth step) must be addressed right for the tokens to match. Output blocks
    filled by rows are hashed: a later prompt that repeats a request's output finds them cached."""
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
        # every step after the prefill feeds the decode rows: finishing requests leave as rows, none decodes
        # otherwise
        assert engine.scheduler.batch.advances == engine.stats()["steps"] - 1 == 40 - 1
        assert len(engine.scheduler.batch) == 0 and not engine.scheduler.batch.prefilling

        follow_up = prompts[3] + want[3][:30]  # 51 tokens: 12 full blocks, 7 of them written by decode rows
        again = engine.generate([follow_up], greedy(8))[0]
        assert again.num_cached_tokens == (len(follow_up) - 1) // 4 * 4
        assert again.token_ids == hf_greedy(path, follow_up, 8)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("async_pipeline", MODES)
def test_queued_requests_join_the_running_batch_as_rows(root, async_pipeline, monkeypatch):
    """Three seats for seven requests: each finish admits a waiting request, which prefills beside the decode rows
    (with chunked prefill: budget 6 tokens) and then becomes a row, once. Outputs equal transformers'; after the
    first two steps every step feeds rows."""
    path = build_tiny("qwen3", root)
    prompts = random_prompts([9, 4, 13, 7, 2, 11, 6], seed=57)
    lengths = [14, 22, 9, 17, 12, 6, 19]
    want = [hf_greedy(path, p, n) for p, n in zip(prompts, lengths)]
    appended = spy_appended(monkeypatch)
    engine = make_engine(path, async_pipeline, max_num_seqs=3, max_num_batched_tokens=6)
    try:
        outs = engine.generate(prompts, [greedy(n) for n in lengths])
        assert [o.token_ids for o in outs] == want
        assert kv_blocks_used_after_settling(engine) == 0
        stats = engine.stats()
        assert stats["preemptions"] == 0
        # the first two steps prefill the first prompt (9 tokens, 6 a step); every later step feeds rows
        assert engine.scheduler.batch.advances == stats["steps"] - 2
    finally:
        engine.shutdown()
    assert len(appended) == len(set(appended)) == len(prompts)  # each request became a row exactly once


def _mixed_params(path, prompts):
    free_run = hf_greedy(path, prompts[1], 30)
    # a token first sampled well after the prompt, so it arrives while the requests are decode rows
    stop_tok = next(t for i, t in enumerate(free_run) if i >= 8 and t not in free_run[:i])
    return [
        SamplingParams(max_tokens=30, temperature=0.8, top_k=20, seed=7, ignore_eos=True),
        greedy(30, stop_token_ids=[stop_tok]),
        greedy(30, min_tokens=20, stop_token_ids=[stop_tok]),
        greedy(30, repetition_penalty=1.3),
        greedy(30, frequency_penalty=2.0),  # strong: a token left out of its counts changes the next pick
        greedy(26),
    ]


@pytest.mark.parametrize("async_pipeline", MODES)
def test_sampling_stops_penalties_and_streaming_in_one_running_batch(root, async_pipeline):
    """Sampling, stop tokens, min_tokens, penalties and streaming in one batch, on three seats (two requests join
    later): greedy requests give transformers' tokens (its processors for the penalties and min_tokens), the seeded
    one its own draws as when run alone; finish reasons match, and streamed tokens are the final ones."""
    path = build_tiny("llama", root)
    prompts = random_prompts([7, 12, 5, 16, 9, 10], seed=61)
    params = _mixed_params(path, prompts)
    engine = make_engine(path, async_pipeline, max_num_seqs=3)
    try:
        finals, streamed = stream_all(engine, prompts, params)
        assert engine.scheduler.batch.advances > 0
        assert kv_blocks_used_after_settling(engine) == 0
    finally:
        engine.shutdown()
    want, reasons = references(path, async_pipeline, prompts, params)
    assert [o.token_ids for o in finals] == want
    assert [o.finish_reason for o in finals] == reasons
    assert finals[1].finish_reason == "stop" and len(finals[1].token_ids) >= 9 and finals[5].finish_reason == "length"
    assert streamed == [o.token_ids for o in finals]


def _run_sampled(path, async_pipeline, max_num_seqs, monkeypatch=None):
    """Eight seeded requests, each sampling with its own settings: with four seats rows finish and waiting requests
    take their place. Returns (tokens of each, steps, the rows read by each call that read sampling settings from
    requests)."""
    from backend.executor import packer, row_sampling

    calls = []
    if monkeypatch is not None:
        for module, name in ((packer, "fill_request_rows"), (row_sampling, "request_columns")):
            real = getattr(module, name)
            monkeypatch.setattr(module, name, lambda *a, _real=real: calls.append(len(a[0])) or _real(*a))
    prompts = random_prompts([7, 12, 5, 16, 9, 4, 11, 8], seed=63)
    settings = [dict(temperature=0.8, top_k=20), dict(temperature=1.0, top_p=0.9), dict(temperature=0.7, min_p=0.1),
                dict(temperature=1.2, top_k=5, top_p=0.8), dict(temperature=0.0), dict(temperature=0.9),
                dict(temperature=0.6, top_p=0.5), dict(temperature=1.0, top_k=3)]
    lengths = [30, 18, 25, 40, 12, 22, 35, 16]
    params = [SamplingParams(max_tokens=n, seed=100 + i, ignore_eos=True, **kw)
              for i, (n, kw) in enumerate(zip(lengths, settings))]
    engine = make_engine(path, async_pipeline, max_num_seqs=max_num_seqs)
    try:
        outs = engine.generate(prompts, params)
        assert [len(o.token_ids) for o in outs] == lengths
        return [o.token_ids for o in outs], engine.stats()["steps"], list(calls), prompts
    finally:
        engine.shutdown()


@pytest.mark.parametrize("async_pipeline", MODES)
def test_decode_rows_keep_their_sampling_settings_between_row_changes(root, async_pipeline, monkeypatch):
    """The rows' sampling settings are read from each request a few times in its life, not once a step: kept per
    row while the rows stay the same (each row's step index then moves with its token count), and following the
    rows as they leave and join (only a joiner's own settings are read). The seeded draws are each request's own:
    those of the same request run alone, token for token; the greedy one's are transformers'."""
    path = build_tiny("llama", root)
    got, steps, reads, prompts = _run_sampled(path, async_pipeline, 4, monkeypatch)
    monkeypatch.undo()
    alone, _, _, _ = _run_sampled(path, async_pipeline, 1)
    assert got == alone
    assert got[4] == hf_greedy(path, prompts[4], 12)
    assert steps > 60 and len(reads) < steps // 4
    assert sum(reads) <= 3 * len(got)  # eight requests: at most three reads of each one's settings


@pytest.mark.parametrize("async_pipeline", MODES)
def test_abort_of_a_decode_row_returns_every_block(root, async_pipeline, monkeypatch):
    """The aborted request leaves the running batch as a deleted row; the others go on as rows, unchanged."""
    from backend.core.running_batch import RunningBatch

    deleted, real_delete = [], RunningBatch._delete

    def delete(self, rows):
        deleted.extend(self.requests[row].request_id for row in rows.tolist())
        return real_delete(self, rows)

    monkeypatch.setattr(RunningBatch, "_delete", delete)
    path = build_tiny("llama", root)
    prompts = random_prompts([5, 8, 11], seed=71)
    want = [hf_greedy(path, prompts[i], 200) for i in (0, 2)]
    engine = make_engine(path, async_pipeline)
    try:
        streams = [engine.add_request(p, greedy(200), request_id=f"r{i}") for i, p in enumerate(prompts)]
        for out in streams[1]:
            if len(out.token_ids) >= 12:
                break
        rows_before = engine.scheduler.batch.advances
        assert rows_before > 0
        engine.abort("r1")
        victim = streams[1].result()
        rest = [streams[0].result(), streams[2].result()]
        assert victim.finish_reason == "abort" and 12 <= len(victim.token_ids) < 200
        assert [o.token_ids for o in rest] == want
        assert "r1" in deleted and deleted.index("r1") < 2  # it left as a row, before the others ended
        assert engine.scheduler.batch.advances - rows_before > 150  # the rows went on without the aborted one
        assert kv_blocks_used_after_settling(engine) == 0
    finally:
        engine.shutdown()


@pytest.mark.parametrize("async_pipeline", MODES)
def test_rows_that_may_end_are_checked_one_by_one_inside_a_step_of_rows(root, async_pipeline, monkeypatch):
    """16 rows of spread lengths, two with a stop token: steps where a few rows near their limit or sample a stop
    token update only those rows one by one and the rest all at once, also when rows left the batch after the step
    was packed (its rows as packed); tokens, finish reasons, streamed tokens and freed blocks are transformers'
    (the sampled row's: its own, run alone)."""
    from backend.core.step_update import StepUpdater

    path = build_tiny("llama", root)
    prompts = random_prompts([5 + (i * 7) % 13 for i in range(16)], seed=81)
    stop_tok = hf_greedy(path, prompts[3], 20)[11]
    params = [greedy(12 + (i * 5) % 23) for i in range(16)]
    params[3] = greedy(30, stop_token_ids=[stop_tok])
    params[9] = SamplingParams(max_tokens=30, temperature=0.9, seed=4, stop_token_ids=[stop_tok], ignore_eos=True)
    risky_steps = []
    changed_updates = []  # per step updated after its rows changed: whether the update over all rows took it
    original = StepUpdater._update_decode_rows

    def spy(self, st, result):
        changed = st.rows_version != st.batch.rows.version
        out = original(self, st, result)
        if out is not None and out[1]:
            risky_steps.append(len(out[1]))
        if changed:
            changed_updates.append(out is not None)
        return out

    monkeypatch.setattr(StepUpdater, "_update_decode_rows", spy)
    engine = make_engine(path, async_pipeline)
    try:
        finals, streamed = stream_all(engine, prompts, params)
        blocks = kv_blocks_used_after_settling(engine)
    finally:
        engine.shutdown()
    assert risky_steps and max(risky_steps) <= 4  # the update over all rows ran, with at most a quarter checked
    assert any(changed_updates) == async_pipeline  # only a queued step sees rows change before its update
    want, reasons = references(path, async_pipeline, prompts, params)
    assert [o.token_ids for o in finals] == want
    assert [o.finish_reason for o in finals] == reasons
    assert finals[3].finish_reason == "stop" and len(finals[3].token_ids) == 12
    assert streamed == [o.token_ids for o in finals]
    assert blocks == 0


def _request(i, prompt_len, outputs, block_ids, **kw):
    """A request with `outputs` output tokens fed and the next one pending (as a decode row holds it)."""
    from backend.request import Request

    req = Request(f"r{i}", [3] * prompt_len, SamplingParams(**{"max_tokens": 50, **kw}), seed=1000 + i,
                  eos_token_ids=frozenset({2}))
    req.output_token_ids = [5] * outputs
    req.num_computed_tokens = prompt_len + outputs
    req.num_tokens = prompt_len + outputs + 1
    req.block_ids = block_ids
    return req


def _new_batch(reqs, block_size=16, max_blocks=8):
    from backend.core.running_batch import RunningBatch

    rb = RunningBatch(block_size=block_size, max_model_len=256, max_blocks=max_blocks)
    if reqs:
        rb._append(list(reqs), np.arange(len(reqs)))
    return rb


def test_row_sampling_settings_follow_rows_leaving_and_joining():
    """After rows leave and join, the kept settings equal a fresh read of every row, with only the joiners read."""
    from backend.executor import row_sampling, sampler

    def request(i):
        # blocks cover its tokens
        return _request(i, 4 + i, i, [2 * i + 1, 2 * i + 2][:-(-(4 + 2 * i) // 16)], temperature=0.5 + 0.1 * i,
                        top_p=0.9 if i % 2 else 1.0, top_k=i % 3 * 10, seed=i)

    def arrays(n):
        return np.zeros((6, n), np.float32), np.zeros((2, n), np.int64), np.zeros(n, np.int32)

    rb = _new_batch([request(i) for i in range(6)])
    kept = row_sampling.RowSamplingSettings()
    kept.fill(rb, *arrays(6))
    rb.advance(1)  # every row's step index moves by one
    rb._delete(np.array([1, 4]))
    rb._append([request(6), request(7)], np.array([0, 1]))
    rb._delete(np.array([0]))
    reads = []
    real = row_sampling.request_columns
    row_sampling.request_columns = lambda *a: reads.append(len(a[0])) or real(*a)
    try:
        got = arrays(len(rb))
        flags = kept.fill(rb, *got)
    finally:
        row_sampling.request_columns = real
    assert reads == [2]  # the two joiners only
    want = arrays(len(rb))
    want_flags = fill_host_rows([r.params for r in rb.requests], [r.seed for r in rb.requests],
                                        [r.num_output_tokens - 1 for r in rb.requests], *want)
    assert [r.request_id for r in rb.requests] == ["r7", "r5", "r2", "r3", "r6"]  # each hole taken by the last row
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    assert flags == want_flags


def test_plain_greedy_rows_sample_as_neutral_greedy_rows_without_reading_a_request():
    """Plain-greedy rows all sample the argmax, whatever their seeds or cutoffs: their host rows are the neutral
    greedy rows (as padding rows), their flags all-greedy, and no request's settings are read, however the rows
    changed; the first sampled joiner brings every row's own settings back."""
    from backend.executor import row_sampling, sampler

    def request(i, **kw):
        return _request(i, 4 + i, i, [2 * i + 1, 2 * i + 2][:-(-(4 + 2 * i) // 16)], seed=i, **kw)

    def arrays(n, fill=7):
        return np.full((6, n), fill, np.float32), np.full((2, n), fill, np.int64), np.full(n, fill, np.int32)

    greedy_kw = [dict(temperature=0.0), dict(temperature=0.0, top_k=5, top_p=0.5, min_p=0.1)]
    rb = _new_batch([request(i, **greedy_kw[i % 2]) for i in range(5)])
    assert rb.all_plain_greedy
    kept = row_sampling.RowSamplingSettings()
    reads = []
    real = row_sampling.request_columns
    row_sampling.request_columns = lambda *a: reads.append(len(a[0])) or real(*a)
    try:
        for change in (None, "delete", "append"):
            if change == "delete":
                rb._delete(np.array([1, 3]))
            elif change == "append":
                rb._append([request(8, **greedy_kw[1])], np.array([0]))
            got = arrays(len(rb))
            flags = kept.fill(rb, *got)
            want = arrays(len(rb), fill=3)
            sampler.fill_padding_rows(*want)
            for g, w in zip(got, want):
                np.testing.assert_array_equal(g, w)
            assert flags == sampler.row_flags(want[0], want[2], -1) and flags["all_greedy"]
        assert reads == []
        rb._append([request(9, temperature=0.8, top_k=20)], np.array([1]))
        assert not rb.all_plain_greedy
        got = arrays(len(rb))
        flags = kept.fill(rb, *got)
    finally:
        row_sampling.request_columns = real
    assert reads == [len(rb)]  # every row's own settings, read once
    want = arrays(len(rb))
    want_flags = fill_host_rows([r.params for r in rb.requests], [r.seed for r in rb.requests],
                                        [r.num_output_tokens - 1 for r in rb.requests], *want)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    assert flags == want_flags and flags["any_top_k"] and not flags["all_greedy"]


def test_plain_greedy_rows_of_a_step_are_packed_as_neutral_greedy_rows_without_reading_their_settings():
    """A step whose sampled requests (no decode rows: prefilled requests) are all plain greedy (whatever their
    cutoffs and seeds) writes the neutral greedy rows and all-greedy flags without reading a request's settings; one
    sampled request among them brings every row's own settings back, as fill_host_rows writes them."""
    from backend.core.scheduler import ScheduledBatch
    from backend.executor import packer as packer_module
    from backend.executor import sampler
    from backend.executor.packer import SlotPacker
    from backend.executor.pipeline import Pipeline, SlotLayout
    from backend.request import Request
    from backend.runtime.timeline import Timeline
    from backend.step_records import StepState

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
            st = StepState(ScheduledBatch(0, _new_batch([]), requests=list(reqs)), slot, sampled=list(reqs))
            tensors = packer.sampling_rows(st, rows=4)
            n = len(reqs)
            want = np.zeros((6, 4), np.float32), np.zeros((2, 4), np.int64), np.zeros(4, np.int32)
            assert reads == ([len(reqs)] if read else [])  # every row's settings read, or none
            if read:
                want_flags = fill_host_rows([r.params for r in reqs], [r.seed for r in reqs],
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


def test_a_rows_request_counts_are_right_at_every_moment():
    """advance counts in the batch only, yet a row's request reads the right counts at once (its computed tokens,
    its one pending token, the newest step), as counting every step on the request would give; its token count and
    newest step cannot be set while it is a row; a row that leaves, and every row when the batch is released, keeps
    its counts and newest step from then on; a request that is no row is left alone."""

    def request(i):
        return _request(i, 4 + i, i, [2 * i + 1, 2 * i + 2])  # i outputs fed, the next one pending

    def counts(req):
        return req.num_computed_tokens, req.num_tokens, req.last_step_id

    reqs = [request(i) for i in range(4)]
    start = [counts(r)[:2] for r in reqs]
    outsider = request(5)
    outsider.last_step_id = 3
    rb = _new_batch(reqs)
    assert all(r.row_batch is rb for r in reqs)
    assert [counts(r)[:2] for r in reqs] == start  # joining changes no count
    rb.advance(10)
    assert [counts(r) for r in reqs] == [(c + 1, t + 1, 10) for c, t in start]
    rb.advance(11)
    assert [counts(r) for r in reqs] == [(c + 2, t + 2, 11) for c, t in start]
    assert rb.computed.tolist() == [r.num_computed_tokens for r in reqs]
    assert [r.num_output_tokens for r in reqs] == [i + 3 for i in range(4)]
    assert [r.num_pending for r in reqs] == [3] * 4  # two steps scheduled since, their tokens not read yet
    for req in reqs:
        req.accept_token(6)
        req.accept_token(6)
    assert [r.num_pending for r in reqs] == [1] * 4
    for name in ("num_tokens", "last_step_id"):
        with pytest.raises(RuntimeError):
            setattr(reqs[0], name, 99)
    assert counts(reqs[0]) == (start[0][0] + 2, start[0][1] + 2, 11)
    rb._delete(np.array([1]))  # r1 leaves: it keeps its counts, and the batch forgets it
    assert reqs[1].row_batch is None and counts(reqs[1]) == (start[1][0] + 2, start[1][1] + 2, 11)
    joiner = request(7)
    rb._append([joiner], np.array([0]))
    rb.advance(12)
    assert counts(reqs[1]) == (start[1][0] + 2, start[1][1] + 2, 11)  # no row: advance leaves it alone
    reqs[1].num_tokens = start[1][1] + 3  # its own again: settable
    assert reqs[1].num_tokens == start[1][1] + 3
    assert counts(joiner) == (joiner.num_prompt_tokens + 8, joiner.num_prompt_tokens + 9, 12)  # one step since
    assert [counts(r) for r in (reqs[0], reqs[2], reqs[3])] == [(c + 3, t + 3, 12) for c, t in
                                                                (start[0], start[2], start[3])]
    assert rb.computed.tolist() == [r.num_computed_tokens for r in rb.requests]
    assert counts(outsider) == (outsider.num_prompt_tokens + 5, outsider.num_prompt_tokens + 6, 3)
    rb.release_all()
    assert all(r.row_batch is None for r in rb.requests)
    released = [counts(r) for r in rb.requests]
    assert released == [(c, c + 1, 12) for c in rb.computed.tolist()]
    rb.advance(13)  # a released batch counts for no request any more
    assert [counts(r) for r in rb.requests] == released
    rb.requests[0].num_tokens = released[0][1] + 1  # settable: no row
    assert rb.requests[0].num_tokens == released[0][1] + 1


def test_batch_flags_and_stop_tokens_follow_rows_leaving():
    """all_plain_greedy, any_edits_logits, stop_ids and the rows checked every step (logprobs) are those of the rows
    there now: a row that leaves takes its part away (a stop token two rows hold stays until both left)."""
    def request(i, **kw):
        return _request(i, 4, 0, [i + 1], **kw)

    plain = request(0, temperature=0.0, ignore_eos=True)  # no stop token at all
    plain_eos = request(1, temperature=0.0)  # stops at EOS (2)
    sampled = request(2, temperature=0.8, stop_token_ids=[7])
    editing = request(3, temperature=0.0, logit_bias={5: 1.0}, stop_token_ids=[7, 9], ignore_eos=True)
    logprobs = request(4, temperature=0.0, logprobs=2, ignore_eos=True)
    rb = _new_batch([plain, plain_eos, sampled, editing, logprobs])
    assert not rb.all_plain_greedy and rb.any_edits_logits and rb.stop_ids == {2, 7, 9}

    def checked_rows():
        """The rows the step update checks one by one for tokens that end no request, far from any limit."""
        rb.packed(list(rb.requests))
        return rb.packed_rows[rb.version].rows_that_may_end([100] * len(rb)).tolist()

    assert checked_rows() == [4]
    rb.remove(sampled)  # its row taken by the last one: plain plain_eos logprobs editing
    assert not rb.all_plain_greedy and rb.any_edits_logits and rb.stop_ids == {2, 7, 9}
    assert checked_rows() == [2]  # the logprobs row moved into the hole
    rb.remove(editing)
    assert not rb.all_plain_greedy and not rb.any_edits_logits and rb.stop_ids == {2}
    rb.remove(logprobs)
    assert rb.all_plain_greedy and not rb.any_edits_logits and rb.stop_ids == {2}
    assert checked_rows() == []
    again = request(5, temperature=0.9, seed=1, stop_token_ids=[2])
    rb._append([again], np.array([0]))
    assert not rb.all_plain_greedy and rb.stop_ids == {2}
    rb._delete(np.array([rb.requests.index(again)]))  # a sampled row that leaves: all plain greedy again
    assert rb.all_plain_greedy and rb.stop_ids == {2}
    rb.remove(plain_eos)
    assert rb.all_plain_greedy and rb.stop_ids == frozenset()
    assert [r.request_id for r in rb.requests] == ["r0"]


@pytest.mark.parametrize("async_pipeline", MODES)
def test_logprobs_requests_are_decode_rows_and_report_every_token(root, async_pipeline, monkeypatch):
    """Requests asking for logprobs (greedy, 2 top tokens) run as decode rows beside plain ones; their rows are
    checked one by one every step (the others updated at once), and each of their tokens comes with its logprob,
    rank and top tokens as transformers' logits give them; tokens are transformers', streamed ones the final ones."""
    from backend.core.step_update import StepUpdater

    checked_ids = []  # per update over all rows: the requests of the rows it checked one by one
    original = StepUpdater._update_decode_rows

    def spy(self, st, result):
        out = original(self, st, result)
        if out is not None:
            checked_ids.append({result.requests[i].request_id for i in out[1]})
        return out

    monkeypatch.setattr(StepUpdater, "_update_decode_rows", spy)
    appended = spy_appended(monkeypatch)
    path = build_tiny("llama", root)
    prompts = random_prompts([6, 9, 4, 11, 7, 5, 8, 10], seed=33)
    lengths = [20, 16, 24, 18, 22, 14, 19, 21]
    params = [greedy(n, logprobs=2 if i in (2, 5) else None) for i, n in enumerate(lengths)]
    engine = make_engine(path, async_pipeline)
    try:
        finals, streamed = stream_all(engine, prompts, params)
        assert kv_blocks_used_after_settling(engine) == 0
    finally:
        engine.shutdown()
    logprob_ids = {finals[2].request_id, finals[5].request_id}
    assert logprob_ids <= set(appended) and len(appended) == len(prompts)  # every request became a row
    assert any(logprob_ids <= ids for ids in checked_ids)
    assert [o.token_ids for o in finals] == [hf_greedy(path, p, n) for p, n in zip(prompts, lengths)]
    assert streamed == [o.token_ids for o in finals]
    model = hf_model(path)
    for i, out in enumerate(finals):
        if params[i].logprobs is None:
            continue
        assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
        with torch.no_grad():
            logits = model(torch.tensor([prompts[i] + out.token_ids])).logits[0, len(prompts[i]) - 1:-1]
        want = torch.log_softmax(logits.float(), dim=-1)
        for pos, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs)):
            assert entry["token_id"] == tok and entry["rank"] == 1
            assert entry["logprob"] == pytest.approx(want[pos, tok].item(), abs=1e-4)
            top = want[pos].topk(2)
            assert [t["token_id"] for t in entry["top_logprobs"]] == top.indices.tolist()
            assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx(top.values.tolist(), abs=1e-4)


@pytest.mark.parametrize("async_pipeline", MODES)
def test_the_per_row_update_sees_the_counts_the_running_batch_keeps(root, async_pipeline, monkeypatch):
    """Requests the per-row update looks at (rows that may end, prefilled requests that became rows since their step
    was scheduled) hold the token counts the batch keeps for their rows, though advance counts in the batch only."""
    from backend.core.step_update import StepUpdater

    real, checked = StepUpdater._update_rows, [0]

    def update_rows(self, result, rows, next_state, events, finish):
        rb = self.scheduler.batch
        where = {id(r): row for row, r in enumerate(rb.requests)}
        for i in rows:
            req, row = result.requests[i], where.get(id(result.requests[i]))
            if row is not None:
                assert req.row_batch is rb
                assert (req.num_computed_tokens, req.num_tokens) == (rb.computed[row], rb.computed[row] + 1)
                checked[0] += 1
        real(self, result, rows, next_state, events, finish)

    monkeypatch.setattr(StepUpdater, "_update_rows", update_rows)
    path = build_tiny("llama", root)
    prompts = random_prompts([5, 11, 3, 8, 14, 6, 9, 4], seed=17)
    lengths = [19, 7, 26, 12, 9, 23, 15, 30]
    outs = generate_as_rows(path, async_pipeline, prompts, lengths, max_num_seqs=3)
    assert [o.token_ids for o in outs] == [hf_greedy(path, p, n) for p, n in zip(prompts, lengths)]
    assert checked[0] > 0


@pytest.mark.parametrize("async_pipeline", MODES)
def test_rows_that_run_out_of_kv_blocks_take_them_one_by_one_and_equal_transformers(
        root, async_pipeline, monkeypatch):
    """Too few free blocks for every row that needs one: the rows take blocks one at a time by their token counts
    (the batch's), preempting the newest running requests; tokens stay transformers' and every block comes back."""
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
        assert engine.scheduler.batch.advances > 0 and stats["preemptions"] > 0
        assert kv_blocks_used_after_settling(engine) == 0
    finally:
        engine.shutdown()
    assert [o.token_ids for o in outs] == [hf_greedy(path, p, n) for p, n in zip(prompts, lengths)]
    assert short[0] > 0


def test_rows_gone_since_follows_deletes_and_appends():
    """Which of a version's rows left since: deletes (the last row moving into each hole) compose, appends keep the
    old rows' indices, and a change that is no longer recorded gives None."""
    def request(i):
        return _request(i, 4, 0, [i + 1])

    rb = _new_batch([])
    assert rb.version == 0 and rb.rows_gone_since(0, 0) == []
    rb._append([request(i) for i in range(6)], np.array(range(6)))  # version 1
    assert rb.rows_gone_since(0, 0) == [] and rb.rows_gone_since(1, 6) == []
    rb._delete(np.array([1, 4]))  # each hole taken by the last row: r0 r5 r2 r3
    assert [r.request_id for r in rb.requests] == ["r0", "r5", "r2", "r3"]
    rb._append([request(6)], np.array([0]))  # r0 r5 r2 r3 r6
    assert rb.rows_gone_since(1, 6) == [1, 4] and rb.rows_gone_since(2, 4) == []
    rb._delete(np.array([0, 3]))  # r6 r5 r2
    assert [r.request_id for r in rb.requests] == ["r6", "r5", "r2"]
    assert rb.rows_gone_since(1, 6) == [0, 1, 3, 4]
    assert rb.rows_gone_since(2, 4) == [0, 3]
    assert rb.rows_gone_since(3, 5) == [0, 3]
    for _ in range(8):  # more changes than are kept
        rb._append([request(7)], np.array([0]))
    assert rb.rows_gone_since(1, 6) is None


def test_block_tables_follow_rows_leaving_joining_and_growing():
    """The rows' block tables stay each row's blocks in row order through deletes (their store rows reused by later
    joiners), appends, blocks added, and the store growing past its first size."""
    import random

    rng = random.Random(7)
    made = iter(range(10_000))

    def request():
        return _request(next(made), 4, 0, [rng.randrange(1, 1000) for _ in range(rng.randint(1, 12))],
                        max_tokens=500)

    rb = _new_batch([request() for _ in range(5)], max_blocks=16)
    first_size = len(rb.table_store)
    for _ in range(200):
        move = rng.random()
        if move < 0.3 and len(rb) > 1:
            rb._delete(np.array(sorted(rng.sample(range(len(rb)), rng.randint(1, min(3, len(rb) - 1))))))
        elif move < 0.6:
            joiners = [request() for _ in range(rng.randint(1, 6))]
            rb._append(joiners, np.zeros(len(joiners), dtype=np.int64))
        else:
            rows = [row for row in rng.sample(range(len(rb)), rng.randint(1, len(rb)))
                    if len(rb.requests[row].block_ids) < 16]
            blocks = [rng.randrange(1, 1000) for _ in rows]
            for row, block in zip(rows, blocks):
                rb.requests[row].block_ids.append(block)
            if rows:
                rb.add_blocks(np.array(rows), blocks)
        assert rb.tables.shape == (len(rb), 16)
        for row, req in enumerate(rb.requests):
            assert rb.num_blocks[row] == len(req.block_ids)
            assert rb.tables[row, :len(req.block_ids)].tolist() == req.block_ids
    assert len(rb.table_store) > first_size  # the store grew at least once


def _edit_params(path, prompts):
    free_run = hf_greedy(path, prompts[0], 24)
    # request 4 may stop from its output token `edge` on, and its free run samples its stop token there: the ban
    # must lift at exactly that step (it reads the request's output count), or the request runs on
    edge_run = hf_greedy(path, prompts[4], 24)
    edge = next(i for i, t in enumerate(edge_run) if i >= 8 and t not in edge_run[:i])
    return [
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


@pytest.mark.parametrize("async_pipeline", MODES)
def test_rows_with_logit_edits_equal_transformers_and_their_own_draws(root, async_pipeline, monkeypatch):
    """Ten requests on three seats, some with logit_bias, bad_words or min_tokens beside plain greedy and seeded
    sampled ones: rows with logit edits in a running batch that rows leave and join. Greedy requests give
    transformers' tokens (its processors for the edits), sampled ones their own draws as when run alone; finish
    reasons match, streamed tokens are the final ones, and every block comes back."""
    from backend.core.running_batch import RunningBatch

    editing_steps, real_advance = [0], RunningBatch.advance

    def advance(self, step_id):
        editing_steps[0] += self.any_edits_logits
        return real_advance(self, step_id)

    monkeypatch.setattr(RunningBatch, "advance", advance)
    path = build_tiny("llama", root)
    prompts = random_prompts([6, 11, 4, 9, 13, 5, 8, 10, 7, 12], seed=91)
    params = _edit_params(path, prompts)
    engine = make_engine(path, async_pipeline, max_num_seqs=3)
    try:
        finals, streamed = stream_all(engine, prompts, params)
        blocks = kv_blocks_used_after_settling(engine)
    finally:
        engine.shutdown()
    assert editing_steps[0] > 20  # steps whose rows held a request with logit edits
    want, reasons = references(path, async_pipeline, prompts, params)
    assert [o.token_ids for o in finals] == want
    assert [o.finish_reason for o in finals] == reasons
    assert streamed == [o.token_ids for o in finals]
    assert blocks == 0
    four = finals[4].token_ids
    assert finals[4].finish_reason == "stop" and len(four) == four.index(four[-1]) + 1


@pytest.mark.parametrize("async_pipeline", MODES)
def test_each_pack_of_rows_writes_every_rows_kv_slot_and_block_table_as_its_request_holds_them(
        root, async_pipeline, monkeypatch):
    """The rows' KV slots are kept as arrays (one more each step, a new block's first slot when one starts) and their
    block tables written whole only for the rows that moved since the slot's last pack (a row taking a deleted one's
    place, a joiner): after every pack of rows each row's position, slot and table are what its request's counts and
    blocks give."""
    from backend.executor.packer import SlotPacker

    checked, incremental, some_moved = [0], [0], [0]
    real_pack, real_tables = SlotPacker._pack_rows, SlotPacker._write_row_tables

    def tables(slot, rb):
        held = slot.row_tables
        if held is not None and held[0] == rb.serial:
            incremental[0] += 1
            moved = int((held[1][:len(rb)] != rb.table_ids).sum())
            some_moved[0] += 0 < moved <= len(rb) // 2
        real_tables(slot, rb)

    def pack(self, st, prev):
        real_pack(self, st, prev)
        if not st.batch.num_rows:
            return
        h, bs = st.slot.np, self.block_size
        assert st.batch.requests[:st.batch.num_rows] == st.batch.rows.requests
        for i, req in enumerate(st.batch.rows.requests):
            pos = req.num_computed_tokens - 1
            assert h["positions"][i] == pos
            assert h["slot_mapping"][i] == req.block_ids[pos // bs] * bs + pos % bs
            assert h["block_tables"][i, :len(req.block_ids)].tolist() == req.block_ids
            assert h["query_start_loc"][i + 1] == i + 1 and h["logits_idx"][i] == i
        checked[0] += 1

    monkeypatch.setattr(SlotPacker, "_pack_rows", pack)
    monkeypatch.setattr(SlotPacker, "_write_row_tables", staticmethod(tables))
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
    """Decode rows do not count their steps one by one: the batch does, and a row's request reads its counts from
    it. Whenever a request finishes, its newest step is the newest scheduled step holding it (a step still queued
    then frees its blocks only after it ran), and its pending tokens are its count less its lists."""
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
    outs = generate_as_rows(path, async_pipeline, prompts, lengths, max_num_seqs=4)
    assert [len(o.token_ids) for o in outs] == lengths and len(finished) == len(prompts)
