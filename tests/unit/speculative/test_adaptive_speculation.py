"""Speculation with the draft policy on the asynchronous pipeline: drafted steps (the step in flight read first)
between plain carried-over steps keep outputs equal to the engine without speculation; drafts that always fail
never make a drafted step (the rows watch: their guesses are checked against the tokens they make); drafts that are
kept go on."""
from __future__ import annotations

import numpy as np
import pytest

from backend import SamplingParams
from backend.speculative.draft_policy import MAX_WATCH
from backend.speculative.proposer import Proposer
from tests.tiny_models import VOCAB, kv_blocks_used_after_settling, random_prompts, tiny_engine
from tests.unit.speculative.test_engine_speculation import (OracleProposer, _logprob_values, _reference, _summary,
                                                            path)  # noqa: F401 (path: the tiny model fixture)

SETTINGS = dict(num_kv_blocks=96, max_num_batched_tokens=64)


class ReplayProposer(Proposer):
    """Proposes what followed the history in reference sequences, every token right or (wrong=True) every one
    moved by one, so no greedy row makes it."""

    name = "replay"

    def __init__(self, sequences, wrong: bool) -> None:
        self.sequences = [np.asarray(s, dtype=np.int64) for s in sequences]
        self.wrong = wrong
        self.calls = 0

    def propose(self, history, k):
        self.calls += 1
        h = history.tokens
        for seq in self.sequences:
            if len(seq) > len(h) and np.array_equal(seq[:len(h)], h):
                return [(int(t) + self.wrong) % VOCAB for t in seq[len(h):len(h) + k]]
        return []


def _run(path, prompts, params, proposer=None, **settings):
    engine = tiny_engine(path, True, speculative_method="ngram" if proposer else "", **{**SETTINGS, **settings})
    try:
        if proposer is not None:
            engine.speculator.proposer = proposer
        outs = engine.generate(prompts, params)
        assert kv_blocks_used_after_settling(engine) == 0
        counts = engine.speculator.counts() if proposer is not None else None
        return outs, counts, engine.stats()["steps"]
    finally:
        engine.shutdown()


@pytest.mark.parametrize("decoding", ["greedy", "seeded"])
def test_outputs_equal_on_the_async_pipeline_with_the_policy(path, decoding):
    prompts = random_prompts([3, 30, 9, 57, 1, 16], seed=21)
    sampled = dict(temperature=0.8, top_p=0.9, logprobs=2) if decoding == "seeded" else dict(temperature=0.0)
    params = [SamplingParams(max_tokens=n, ignore_eos=True, seed=i, **sampled)
              for i, n in enumerate((40, 33, 7, 26, 3, 45))]
    want, _, _ = _run(path, prompts, params)
    got, counts, _ = _run(path, prompts, params, OracleProposer(_reference(path, prompts, params)))
    assert _summary(got) == _summary(want)
    assert counts["spec_accepted_tokens"] > 0 and counts["spec_steps"] > 0
    if decoding == "seeded":
        np.testing.assert_allclose(_logprob_values(got), _logprob_values(want), atol=1e-5, rtol=0)


def test_drafts_that_always_fail_never_make_a_drafted_step(path):
    """Four rows, 300 tokens each, every guess wrong: the rows watch from their first step (nothing was checked yet),
    no step drafts, and each row guesses about once in MAX_WATCH steps once its guesses keep failing."""
    prompts = random_prompts([5, 8, 11, 14], seed=22)
    params = [SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)] * 4
    proposer = ReplayProposer(_reference(path, prompts, params, max_tokens=300), wrong=True)
    got, counts, steps = _run(path, prompts, params, proposer, max_model_len=320, num_kv_blocks=400)
    assert [len(o.token_ids) for o in got] == [300] * 4
    assert counts["spec_steps"] == counts["spec_proposed_tokens"] == 0, counts
    assert 4 * (300 // MAX_WATCH) <= proposer.calls <= 4 * (300 // MAX_WATCH + 8), (proposer.calls, steps)


def test_drafts_that_are_kept_go_on(path):
    prompts = random_prompts([5, 8], seed=23)
    params = [SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)] * 2
    proposer = ReplayProposer(_reference(path, prompts, params, max_tokens=120), wrong=False)
    got, counts, steps = _run(path, prompts, params, proposer, max_model_len=160)
    assert [len(o.token_ids) for o in got] == [120] * 2
    assert counts["spec_accepted_tokens"] == counts["spec_proposed_tokens"] > 0
    assert steps < 120 // 2  # most steps emit several tokens a row


@pytest.mark.parametrize("extra", [dict(speculate=False), dict(logit_bias={7: 1.5})])
def test_rows_that_cannot_draft_keep_the_async_pipeline(path, extra):
    """No row may draft (opted out, or logit edits): no step reads the one before first."""
    prompts = random_prompts([5, 8], seed=24)
    params = [SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, **extra)] * 2
    want, _, _ = _run(path, prompts, params)
    engine = tiny_engine(path, True, speculative_method="ngram", **SETTINGS)
    try:
        entered, drafted = [], engine.loop._step_drafted
        engine.loop._step_drafted = lambda: entered.append(1) or drafted()
        got = engine.generate(prompts, params)
    finally:
        engine.shutdown()
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert not entered


class _UntilLength(Proposer):
    """Proposes the reference continuation while the history is shorter than `until`, then nothing."""

    name = "until-length"

    def __init__(self, sequences, until: int) -> None:
        self.sequences = [list(s) for s in sequences]
        self.until = until

    def propose(self, history, k):
        tokens = history.tokens.tolist()
        if len(tokens) >= self.until:
            return []
        for seq in self.sequences:
            if seq[:len(tokens)] == tokens:
                return seq[len(tokens):len(tokens) + k]
        return []


def test_a_step_due_to_draft_that_got_no_draft_stays_in_flight(path):
    """A row drafts while its proposer has drafts; the step at which it has none (due to draft, so the step before
    was read first) is a plain step: it stays in flight, and the next step, no longer due, is launched before it is
    read (carried over from it), as on the async pipeline. Outputs unchanged."""
    prompts = random_prompts([5], seed=25)  # one row: a step has no draft whenever its row has none
    params = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)]
    want, _, _ = _run(path, prompts, params)
    engine = tiny_engine(path, True, speculative_method="ngram", **SETTINGS)
    events: list[tuple[str, int]] = []  # ("plain" / "other" / "drafted" launch, or "read", step id), in order
    inside = []  # non-empty while the loop runs a step due to draft
    loop, runner = engine.loop, engine.parts.runner
    step_drafted, launch, read = loop._step_drafted, runner.launch_forward, runner.read
    launch_drafted = loop._drafted.launch
    loop._step_drafted = lambda: inside.append(1) or (step_drafted(), inside.clear())[0]
    runner.launch_forward = lambda st, prev: events.append(("plain" if inside else "other", st.batch.step_id)) or \
        launch(st, prev)
    loop._drafted.launch = lambda st, d: events.append(("drafted", st.batch.step_id)) or launch_drafted(st, d)
    runner.read = lambda st, *rows: events.append(("read", st.batch.step_id)) or read(st, *rows)
    try:
        engine.speculator.proposer = _UntilLength([p + o.token_ids for p, o in zip(prompts, want)], until=25)
        got = engine.generate(prompts, params)
        accepted = engine.speculator.counts()["spec_accepted_tokens"]
    finally:
        engine.shutdown()
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert accepted > 0
    read_at = {step: i for i, (kind, step) in enumerate(events) if kind == "read"}
    undrafted = [(i, step) for i, (kind, step) in enumerate(events) if kind == "plain"]
    assert undrafted
    # each such step is read only after a later step was launched
    assert all(any(kind != "read" for kind, _ in events[i + 1:read_at[step]]) for i, step in undrafted)


def test_after_a_drafted_step_the_watching_rows_guess_once_the_next_step_is_queued(path):
    """Nothing runs on the device between a drafted step's read and the next launch, so the watching rows' guesses
    (Speculator.watch) wait for that launch and run beside the next step; outputs unchanged."""
    prompts = random_prompts([5, 8], seed=26)
    params = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)] * 2
    want, _, _ = _run(path, prompts, params)
    engine = tiny_engine(path, True, speculative_method="ngram", **SETTINGS)
    events: list[str] = []
    loop, runner, speculator = engine.loop, engine.parts.runner, engine.speculator
    launch, launch_drafted, read_drafted, watch = (runner.launch_forward, loop._drafted.launch, loop._drafted.read,
                                                   speculator.watch)
    runner.launch_forward = lambda st, prev: events.append("launch") or launch(st, prev)
    loop._drafted.launch = lambda st, d: events.append("launch") or launch_drafted(st, d)
    loop._drafted.read = lambda st, d: events.append("drafted read") or read_drafted(st, d)
    speculator.watch = lambda *a: events.append("watch") or watch(*a)
    try:
        speculator.proposer = ReplayProposer([p + o.token_ids for p, o in zip(prompts, want)], wrong=False)
        got = engine.generate(prompts, params)
    finally:
        engine.shutdown()
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    reads = [i for i, e in enumerate(events) if e == "drafted read"]
    assert reads and "watch" in events
    for i in reads:  # up to the next launch (or the end), no guessing
        after = events[i + 1:]
        assert "watch" not in after[:after.index("launch") if "launch" in after else len(after)]
