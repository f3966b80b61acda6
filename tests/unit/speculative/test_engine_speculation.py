"""Speculative decoding in the engine: outputs token-for-token equal to the engine without it (greedy and seeded
sampling, every per-token rule), KV blocks advanced by exactly the tokens emitted, settings validated, stats counted.

Most cases draft with an oracle: a proposer that replays a reference run's continuation (every third proposal with
its last draft wrong), so many drafts are kept and some are not; n-gram and suffix proposals run too."""
from __future__ import annotations

import numpy as np
import pytest

from backend import Engine, EngineConfig, SamplingParams
from backend.speculative.proposer import Proposer
from tests.tiny_models import VOCAB, build_tiny, kv_blocks_used_after_settling, random_prompts, tiny_engine

# every row drafts at every step (the policy off): these cases check verification, not when drafting pays
SETTINGS = dict(num_kv_blocks=96, max_num_batched_tokens=32, speculative_adaptive=False)


class OracleProposer(Proposer):
    """Proposes what followed the history in a reference sequence; every third proposal's last draft is wrong."""

    name = "oracle"

    def __init__(self, sequences) -> None:
        self.sequences = [np.asarray(s, dtype=np.int64) for s in sequences]
        self.calls = 0
        self.finished_lengths: list[tuple[int, int]] = []

    def propose(self, history, k):
        h = history.tokens
        for seq in self.sequences:
            if len(seq) > len(h) and np.array_equal(seq[:len(h)], h):
                drafts = [int(t) for t in seq[len(h):len(h) + k]]
                self.calls += 1
                if self.calls % 3 == 0:
                    drafts[-1] = (drafts[-1] + 1) % VOCAB
                return drafts
        return []

    def finished(self, history, prompt_length):
        self.finished_lengths.append((len(history), prompt_length))


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return build_tiny("llama", str(tmp_path_factory.mktemp("tiny")))


def _run(path, prompts, params, method="", oracle=None, **settings):
    """(outputs, the speculator's counts or None, free blocks at the start and after the run)."""
    engine = tiny_engine(path, False, speculative_method=method, **{**SETTINGS, **settings})
    try:
        if oracle is not None:
            engine.speculator.proposer = oracle
        free_before = engine.block_manager.num_free_blocks
        outs = engine.generate(prompts, params)
        assert kv_blocks_used_after_settling(engine) == 0
        counts = engine.speculator.counts() if engine.speculator is not None else None
        return outs, counts, (free_before, engine.block_manager.num_free_blocks)
    finally:
        engine.shutdown()


def _summary(outs):
    """What must be equal; logprobs to 1e-5: a drafted step's forward has other shapes than one-token steps, so its
    float32 sums differ in the last bits (as a row's do in batches of other sizes)."""
    return [(o.token_ids, o.finish_reason, o.text, o.index, _logprobs(o.logprobs)) for o in outs]


def _logprobs(entries):
    if not entries:
        return None
    return [(e["token_id"], e["rank"], [(t["token_id"], t["rank"]) for t in e.get("top_logprobs", [])])
            for e in entries]


def _logprob_values(outs):
    return np.array([v for o in outs for e in (o.logprobs or ())
                     for v in (e["logprob"], *(t["logprob"] for t in e.get("top_logprobs", [])))])


def _reference(path, prompts, params, max_tokens: int = 40):
    """Each prompt + its free-running continuation (no stops, max_tokens tokens), for the oracle."""
    free = [SamplingParams(**{**_plain(p), "max_tokens": max_tokens, "ignore_eos": True, "stop": [], "stop_token_ids": [],
                              "min_tokens": 0, "logprobs": None}) for p in params]
    outs, _, _ = _run(path, prompts, free)
    n = [p.n for p in params]
    seqs, i = [], 0
    for prompt, k in zip(prompts, n):
        for _ in range(k):
            seqs.append(list(prompt) + outs[i].token_ids)
            i += 1
    return seqs


def _plain(p: SamplingParams) -> dict:
    return {name: getattr(p, name) for name in p.__slots__ if name != "structured_outputs"}


def _equal_with_oracle(path, prompts, params, **settings):
    """Runs without and with speculation (oracle drafts); the outputs must be equal. Returns the counts."""
    want, _, _ = _run(path, prompts, params, **settings)
    oracle = OracleProposer(_reference(path, prompts, params))
    got, counts, (before, after) = _run(path, prompts, params, method="ngram", oracle=oracle, **settings)
    assert _summary(got) == _summary(want)
    np.testing.assert_allclose(_logprob_values(got), _logprob_values(want), atol=1e-5, rtol=0)
    assert after == before
    return counts, oracle


def test_config_validates_speculative_settings():
    with pytest.raises(ValueError, match="ngram, suffix"):
        EngineConfig(speculative_method="medusa").validate()
    for k in (0, 17, "4"):
        with pytest.raises(ValueError, match="num_speculative_tokens"):
            EngineConfig(speculative_method="ngram", num_speculative_tokens=k).validate()
    EngineConfig(speculative_method="ngram", async_pipeline=True).validate()  # drafted steps read the one before
    config = EngineConfig.from_dict({"speculative_method": "suffix", "num_speculative_tokens": "6"}).validate()
    assert (config.speculative_method, config.num_speculative_tokens) == ("suffix", 6)
    assert EngineConfig.from_dict({"speculative_method": ""}).validate().speculative_method == ""
    assert EngineConfig().speculative_method == "" and EngineConfig().num_speculative_tokens == 4
    assert EngineConfig().speculative_adaptive is True
    assert EngineConfig.from_dict({"speculative_adaptive": "false"}).speculative_adaptive is False
    with pytest.raises(ValueError, match="speculative_adaptive"):
        EngineConfig.from_dict({"speculative_adaptive": "flase"})


@pytest.mark.parametrize("budget,seats", [(32, 16), (12, 8)])
def test_greedy_outputs_equal_and_drafts_are_kept(path, budget, seats):
    """Mixed prompt lengths (chunked prefill beside speculating rows), finishing at different steps; with 12 tokens
    and 8 seats a step's drafts are cut to the room its token and logits buffers leave."""
    prompts = random_prompts([3, 30, 9, 57, 1, 16])
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (12, 20, 7, 16, 3, 25)]
    counts, _ = _equal_with_oracle(path, prompts, params, max_num_batched_tokens=budget, max_num_seqs=seats)
    assert counts["spec_steps"] > 0
    assert 0 < counts["spec_accepted_tokens"] < counts["spec_proposed_tokens"]
    per_position = counts["spec_accepted_per_position"]  # a draft is kept only after every one before it
    assert sum(per_position) == counts["spec_accepted_tokens"] and len(per_position) == 4
    assert counts["spec_drafts"] >= per_position[0] and per_position == sorted(per_position, reverse=True)


@pytest.mark.parametrize("k", [1, 3, 16])
def test_seeded_sampling_outputs_equal(path, k):
    prompts = random_prompts([5, 11, 23, 2], seed=3)
    params = [SamplingParams(max_tokens=18, temperature=0.8, top_p=0.9, top_k=40, min_p=0.02, seed=s,
                             ignore_eos=True) for s in (1, 2, 3, 4)]
    counts, _ = _equal_with_oracle(path, prompts, params, num_speculative_tokens=k)
    assert counts["spec_accepted_tokens"] > 0


def _stop_token(path):
    """A token the first prompt's greedy continuation makes at its 6th step (and not before)."""
    prompt = random_prompts([7], seed=5)[0]
    seq = _reference(path, [prompt], [SamplingParams(temperature=0.0)])[0][len(prompt):]
    return prompt, next(t for i, t in enumerate(seq) if i >= 5 and t not in seq[:i])


@pytest.mark.parametrize("case", ["max_tokens", "stop_token", "min_tokens", "stop_string", "n", "logprobs",
                                  "eos", "sampled_logprobs"])
def test_per_token_rules_hold_on_kept_tokens(path, case):
    prompt, stop = _stop_token(path)
    prompts = [prompt, *random_prompts([4, 13], seed=6)]
    base = dict(max_tokens=20, temperature=0.0)
    extra = {"max_tokens": dict(max_tokens=5), "stop_token": dict(stop_token_ids=[stop]),
             "min_tokens": dict(stop_token_ids=[stop], min_tokens=8), "stop_string": dict(stop=[f"<{stop}>"]),
             "n": dict(n=3, temperature=0.9, seed=7), "logprobs": dict(logprobs=3),
             "eos": dict(ignore_eos=False), "sampled_logprobs": dict(temperature=0.7, seed=9, logprobs=0)}[case]
    params = [SamplingParams(**{**base, **extra}) for _ in prompts]
    counts, _ = _equal_with_oracle(path, prompts, params)
    if case != "min_tokens":  # min_tokens edits the logits: those rows do not speculate
        assert counts["spec_accepted_tokens"] > 0


@pytest.mark.parametrize("extra", [dict(speculate=False), dict(logit_bias={5: 2.0}), dict(min_tokens=3),
                                   dict(bad_words=["<73>", "<8>"]), dict(allowed_token_ids=list(range(2, 200, 3)))],
                         ids=["speculate_false", "logit_bias", "min_tokens", "bad_words", "allowed_token_ids"])
def test_rows_with_logit_edits_or_opting_out_do_not_speculate(path, extra):
    prompts = random_prompts([6, 9], seed=8)
    params = [SamplingParams(max_tokens=10, temperature=0.0, **extra)] * 2
    counts, _ = _equal_with_oracle(path, prompts, params)
    assert counts["spec_proposed_tokens"] == 0, extra


@pytest.mark.parametrize("penalty", [dict(repetition_penalty=1.3), dict(presence_penalty=0.8),
                                     dict(frequency_penalty=2.0, temperature=0.5, seed=5)])
def test_rows_with_penalties_count_the_drafts_before_each_position(path, penalty):
    """A drafted position's penalties see the row's outputs, its input token and the drafts before it, as they
    would had those been made one step at a time: outputs equal, with a row without penalties beside."""
    prompts = random_prompts([6, 9, 4], seed=8)
    base = dict(max_tokens=24, temperature=0.0, ignore_eos=True)
    params = [SamplingParams(**{**base, **penalty}), SamplingParams(**{**base, **penalty, "seed": 6}),
              SamplingParams(**base)]
    counts, _ = _equal_with_oracle(path, prompts, params)
    assert counts["spec_accepted_tokens"] > 0


def test_kv_blocks_advance_by_the_tokens_emitted(path):
    """One request: at every step where both runs hold the same number of computed tokens, they hold the same
    number of KV blocks (rejected drafts' blocks returned); all blocks return at the end."""
    prompt = random_prompts([10], seed=9)
    params = [SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)]
    oracle = OracleProposer(_reference(path, prompt, params))
    seen = []
    for method in ("", "ngram"):
        engine = tiny_engine(path, False, speculative_method=method, enable_prefix_caching=False, **SETTINGS)
        try:
            if method:
                engine.speculator.proposer = oracle
            record, refresh = {}, engine.loop.refresh_stats

            def recording(record=record, refresh=refresh, engine=engine):
                for req in engine.scheduler.running:
                    record[req.num_computed_tokens] = engine.block_manager.num_used_blocks
                refresh()

            engine.loop.refresh_stats = recording
            engine.generate(prompt, params)
            assert kv_blocks_used_after_settling(engine) == 0
            seen.append(record)
        finally:
            engine.shutdown()
    plain, speculative = seen
    common = set(plain) & set(speculative)
    assert len(common) >= 5 and len(speculative) < len(plain)
    assert {c: plain[c] for c in common} == {c: speculative[c] for c in common}


def test_finished_requests_feed_the_proposer(path):
    prompts = random_prompts([4, 8], seed=10)
    params = [SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)] * 2
    _, oracle = _equal_with_oracle(path, prompts, params)
    assert sorted(oracle.finished_lengths) == [(13, 4), (17, 8)]


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_real_proposers_keep_outputs_equal(path, method):
    """Prompts that repeat themselves, so the proposers find matches."""
    unit = random_prompts([5, 7], seed=11)
    prompts = [unit[0] * 4, unit[1] * 3 + unit[0]]
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)] * 2
    want, _, _ = _run(path, prompts, params)
    got, counts, (before, after) = _run(path, prompts, params, method=method)
    assert _summary(got) == _summary(want)
    assert after == before
    assert counts["spec_proposed_tokens"] > 0


@pytest.fixture(scope="module")
def smollm2():
    """The default model on the CPU, loaded once: an engine without speculation and one with ngram over it, every
    row drafting at every step (the policy off: what the policy learnt in one test would decide whether the next
    drafts at all)."""
    settings = dict(device="cpu", num_kv_blocks=128, max_num_seqs=8)
    plain = Engine(EngineConfig(**settings))
    spec = Engine(EngineConfig(**settings, speculative_method="ngram", speculative_adaptive=False),
                  model=plain.parts.model, tokenizer=plain.tokenizer)
    yield plain, spec
    spec.shutdown()
    plain.shutdown()


def _accepted(engine) -> int:
    return engine.speculator.counts()["spec_accepted_tokens"]


def test_default_model_greedy_equal_with_ngram(smollm2):
    """SmolLM2 on the CPU: a prompt that invites repetition; greedy outputs equal, some drafts kept."""
    plain, spec = smollm2
    prompt = "Repeat exactly: red green blue, red green blue, red green blue, red green blue,"
    params = SamplingParams(max_tokens=24, temperature=0.0)
    before = _accepted(spec)
    want, got = plain.generate([prompt], params)[0], spec.generate([prompt], params)[0]
    assert got.token_ids == want.token_ids and got.text == want.text
    assert _accepted(spec) > before


def test_preemption_keeps_outputs_equal(path):
    """A KV cache too small for all requests at once: rows are preempted and recomputed, and draft blocks come from
    what is free (never by preempting); outputs unchanged, every block back."""
    prompts = random_prompts([20, 18, 25, 22, 19, 24], seed=3)
    params = [SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)] * len(prompts)
    want, _, _ = _run(path, prompts, params, num_kv_blocks=40)
    oracle = OracleProposer(_reference(path, prompts, params))
    engine = tiny_engine(path, False, speculative_method="ngram", **{**SETTINGS, "num_kv_blocks": 40})
    try:
        engine.speculator.proposer = oracle
        got = engine.generate(prompts, params)
        assert engine.stats()["preemptions"] > 0
        assert kv_blocks_used_after_settling(engine) == 0
        assert engine.speculator.counts()["spec_accepted_tokens"] > 0
    finally:
        engine.shutdown()
    assert _summary(got) == _summary(want)


def test_abort_mid_generation_returns_blocks_and_history(path):
    prompt = random_prompts([12], seed=12)[0]
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    oracle = OracleProposer(_reference(path, [prompt], [params]))
    engine = tiny_engine(path, False, speculative_method="ngram", **SETTINGS)
    try:
        engine.speculator.proposer = oracle
        stream = engine.add_request(prompt, params, request_id="a")
        seen = 0
        for out in stream:
            seen += len(out.delta_token_ids)
            if seen >= 10 and not out.finished:
                engine.abort("a")
        assert out.finish_reason == "abort"
        assert kv_blocks_used_after_settling(engine) == 0
        assert not engine.speculator._histories and oracle.finished_lengths
    finally:
        engine.shutdown()


def test_constrained_rows_beside_speculating_rows(smollm2):
    """Structured outputs (a grammar masks each token) beside free greedy rows on SmolLM2, n-gram drafts: the
    constrained outputs still match, and every output equals a plain run's."""
    import re

    from tests.structured_cases import CHOICES, PROMPT, REGEX

    plain, spec = smollm2
    free_prompt = "Repeat exactly: one two three, one two three, one two three, one two three,"
    free = SamplingParams(max_tokens=40, temperature=0.0)
    constrained = [SamplingParams(max_tokens=40, temperature=1.0, seed=7, structured_outputs=s)
                   for s in ({"regex": REGEX}, {"choice": CHOICES})]
    before = _accepted(spec)
    want = plain.generate([free_prompt, PROMPT, PROMPT], [free, *constrained])
    got = spec.generate([free_prompt, PROMPT, PROMPT], [free, *constrained])
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert re.fullmatch(REGEX, got[1].text) and got[2].text in CHOICES
    assert _accepted(spec) > before


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_constrained_rows_draft_and_keep_their_outputs(smollm2, temperature):
    """Rows with a JSON schema, a regex and a choice take oracle drafts (every third span's last draft wrong, and
    often outside the grammar): each position is masked by the grammar after the drafts before it, the outputs
    equal a plain run's, drafts are kept, and every matcher ends where its output does."""
    import json

    from tests.structured_cases import CHOICES, PROMPT, REGEX, TOOL_SCHEMA

    plain, spec = smollm2
    prompt = plain.tokenizer.encode(PROMPT)
    kinds = ({"json": TOOL_SCHEMA}, {"regex": REGEX}, {"choice": CHOICES})
    params = [SamplingParams(max_tokens=60, temperature=temperature, seed=11 + i, structured_outputs=s)
              for i, s in enumerate(kinds)]
    want = plain.generate([prompt] * 3, params)
    saved = spec.speculator.proposer, spec.speculator.policy
    spec.speculator.proposer = OracleProposer([prompt + o.token_ids for o in want])
    spec.speculator.policy = None  # every row drafts at every step
    before = _accepted(spec)
    try:
        got = spec.generate([prompt] * 3, params)
    finally:
        spec.speculator.proposer, spec.speculator.policy = saved
    assert [(o.token_ids, o.finish_reason) for o in got] == [(o.token_ids, o.finish_reason) for o in want]
    assert json.loads(got[0].text).keys() == TOOL_SCHEMA["properties"].keys()
    assert _accepted(spec) > before


def test_the_length_limit_ends_a_row_at_its_own_token(path):
    """max_model_len reached inside a drafted span: the row emits every token up to the limit, as without drafts
    (the row's count already holds the whole span, so the limit reads the prompt and outputs so far)."""
    prompts = random_prompts([10, 13], seed=11)
    params = [SamplingParams(max_tokens=24 - len(p), temperature=0.0, ignore_eos=True) for p in prompts]
    counts, _ = _equal_with_oracle(path, prompts, params, max_model_len=24)
    assert counts["spec_accepted_tokens"] > 0


def test_a_full_batch_still_drafts(path):
    """As many rows as seats: each still has logits rows for its drafts (max_num_seqs x (1 + k) in a slot)."""
    prompts = random_prompts([6, 9, 12, 15], seed=13)
    params = [SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)] * 4
    counts, _ = _equal_with_oracle(path, prompts, params, max_num_seqs=4)
    assert counts["spec_accepted_tokens"] > 0


def test_streamed_tokens_arrive_once_and_in_order(path):
    """A streaming caller hears every kept token once, in order, several a drafted step, beside a caller that takes
    only the final output: both equal the run without speculation."""
    prompts = random_prompts([9, 14], seed=15)
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)] * 2
    want, _, _ = _run(path, prompts, params)
    oracle = OracleProposer(_reference(path, prompts, params))
    engine = tiny_engine(path, False, speculative_method="ngram", **SETTINGS)
    try:
        engine.speculator.proposer = oracle
        streamed = engine.add_request(prompts[0], params[0], request_id="streamed")
        final_only = engine.add_request(prompts[1], params[1], request_id="final", stream=False)
        deltas = [list(out.delta_token_ids) for out in streamed]
        final = final_only.result()
        accepted = engine.speculator.counts()["spec_accepted_tokens"]
        assert kv_blocks_used_after_settling(engine) == 0
    finally:
        engine.shutdown()
    assert [t for d in deltas for t in d] == want[0].token_ids
    assert final.token_ids == want[1].token_ids
    assert accepted > 0 and max(map(len, deltas)) > 1  # drafts kept: some outputs carried several tokens


@pytest.mark.parametrize("async_pipeline", [True, False])
def test_a_failed_drafted_step_fails_its_requests_and_returns_every_block(path, async_pipeline):
    """Every fifth step raises while rows draft: each request in flight ends once, with the error; every block (the
    drafts' too) comes back, the speculator forgets the requests, and the next requests draft and finish."""
    prompts = random_prompts([6, 9, 12], seed=17)
    params = [SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)] * 3
    reference = _reference(path, prompts, params)
    engine = tiny_engine(path, async_pipeline, speculative_method="ngram",
                         **{**SETTINGS, "test_fault_every_n_steps": 5})
    try:
        engine.speculator.proposer = OracleProposer(reference)
        free = engine.block_manager.num_free_blocks
        outs = engine.generate(prompts, params)
        assert [o.finish_reason for o in outs] == ["error"] * 3
        assert all("injected fault" in o.error for o in outs)
        assert engine.speculator.counts()["spec_steps"] > 0  # drafted steps ran before the fault
        assert kv_blocks_used_after_settling(engine) == 0 and engine.block_manager.num_free_blocks == free
        assert not engine.speculator._histories and engine.healthy
        short = engine.generate([prompts[0]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))[0]
        assert short.finish_reason == "length" and short.token_ids == reference[0][len(prompts[0]):][:3]
    finally:
        engine.shutdown()


def test_a_request_that_never_drafted_gives_the_proposer_its_outputs_alone(path):
    """A request that opts out never has its prompt indexed; when it ends the proposer still learns its outputs, as a
    history of the outputs alone (prompt length 0)."""
    prompts = random_prompts([4, 8], seed=10)
    params = [SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True, speculate=False)]
    want, _, _ = _run(path, prompts, params)
    oracle = OracleProposer(_reference(path, prompts, params))
    got, _, _ = _run(path, prompts, params, method="ngram", oracle=oracle)
    assert _summary(got) == _summary(want)
    assert sorted(oracle.finished_lengths) == [(9, 0), (13, 4)]


def test_long_prompts_are_indexed_a_budget_a_pass(path, monkeypatch):
    """With 4 prompt tokens indexed per proposing pass, the rows' prompts (13 and 18 tokens) take several passes
    before they draft; then they draft, and outputs are unchanged."""
    from backend.speculative import speculator as speculator_module

    monkeypatch.setattr(speculator_module, "PROMPT_INDEX_BUDGET", 4)
    prompts = random_prompts([13, 18], seed=14)
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)] * 2
    want, _, _ = _run(path, prompts, params)
    engine = tiny_engine(path, False, speculative_method="ngram", **SETTINGS)
    waits, history = [], engine.speculator._history
    engine.speculator._history = lambda req: waits.append(h := history(req)) or h
    try:
        engine.speculator.proposer = OracleProposer(_reference(path, prompts, params))
        got = engine.generate(prompts, params)
        accepted = engine.speculator.counts()["spec_accepted_tokens"]
    finally:
        engine.shutdown()
    assert _summary(got) == _summary(want)
    assert waits.count(None) >= (13 + 18) // 4 - 1  # passes that left a prompt half indexed
    assert accepted > 0
