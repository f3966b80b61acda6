"""n > 1 (samples of one prompt sharing its KV blocks) and the logit rules (logit_bias, allowed_token_ids,
bad_words) and truncate_prompt_tokens, against transformers' generate on tiny random models."""
from __future__ import annotations

import pytest

from backend import Engine, EngineConfig, SamplingParams
from backend.executor.logit_rules import LogitEdits
from tests.tiny_models import build_tiny, hf_greedy, kv_blocks_used_after_settling, random_prompts

MODES = [pytest.param(False, id="sync"), pytest.param(True, id="async")]
BLOCK = 4


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return build_tiny("llama", str(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module", params=MODES)
def engine(request, path):
    engine = Engine(EngineConfig(model=path, device="cpu", num_kv_blocks=96, block_size=BLOCK,
                                 max_num_batched_tokens=24, max_num_seqs=16, async_pipeline=request.param))
    yield engine
    engine.shutdown()


class _ForwardRecorder:
    """Wraps a model: counts the tokens of each forward, delegates everything else."""

    def __init__(self, model):
        self.model, self.tokens = model, 0

    def __call__(self, ids, positions, kv_cache, meta, ops=None):
        self.tokens += ids.shape[0]
        return self.model(ids, positions, kv_cache, meta, ops)

    def __getattr__(self, name):
        return getattr(self.model, name)


def greedy(max_tokens, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def test_greedy_samples_share_the_prompt_blocks_and_equal_transformers(engine, path):
    """n = 3 of a 13-token prompt: the second and third samples take the first's 3 full blocks (12 tokens) and
    compute only the last prompt token; every sample equals transformers' greedy output."""
    prompt = random_prompts([13])[0]
    want = hf_greedy(path, prompt, 10)
    recorder = _ForwardRecorder(engine.runner.model)
    engine.runner.model = recorder
    try:
        outs = engine.generate([prompt], greedy(10, n=3))
    finally:
        engine.runner.model = recorder.model
    assert [o.index for o in outs] == [0, 1, 2]
    assert [o.token_ids for o in outs] == [want] * 3
    assert [o.num_cached_tokens for o in outs] == [0, 12, 12]
    # the prompt once, one token each for the other samples' last prompt token, then 9 decode tokens per sample
    assert recorder.tokens == 13 + 2 * 1 + 3 * 9
    assert kv_blocks_used_after_settling(engine) == 0


def test_seeded_samples_equal_single_requests_with_consecutive_seeds(engine):
    """Sample i of a request seeded s draws what a lone request seeded s + i draws, prompt blocks shared or not."""
    prompt = random_prompts([9], seed=3)[0]
    params = dict(max_tokens=12, temperature=1.0, top_p=0.9, ignore_eos=True)
    outs = engine.generate([prompt], SamplingParams(n=4, seed=11, **params))
    singles = engine.generate([prompt] * 4, [SamplingParams(seed=11 + i, **params) for i in range(4)])
    assert [o.token_ids for o in outs] == [s.token_ids for s in singles]
    assert len({tuple(o.token_ids) for o in outs}) > 1


def test_aborting_a_request_ends_every_sample_and_returns_the_blocks(engine):
    prompt = random_prompts([20], seed=4)[0]
    stream = engine.add_request(prompt, greedy(200, n=3), request_id="abort-n")
    first = next(stream)
    stream.cancel()
    finals = stream.results()
    assert first.request_id == "abort-n"
    assert sorted(o.index for o in finals) == [0, 1, 2]
    assert {o.finish_reason for o in finals} == {"abort"}
    assert kv_blocks_used_after_settling(engine) == 0
    again = engine.add_request(prompt, greedy(2), request_id="abort-n")  # the id is free again
    assert again.result().finish_reason == "length"


def test_samples_streamed_and_final_only_agree(engine):
    """Each sample's streamed deltas join to its final output; both kinds of caller see n finals."""
    prompt = random_prompts([6], seed=5)[0]
    params = SamplingParams(n=2, seed=3, temperature=0.8, max_tokens=8, ignore_eos=True)
    stream = engine.add_request(prompt, params, request_id="streamed-n")
    joined: dict[int, list[int]] = {0: [], 1: []}
    for out in stream:
        joined[out.index] += out.delta_token_ids
    finals = stream.results()
    assert [joined[0], joined[1]] == [f.token_ids for f in finals]
    assert [f.token_ids for f in engine.generate([prompt], params)] == [f.token_ids for f in finals]


@pytest.mark.parametrize("bias", [-100.0, 100.0])
def test_logit_bias_equals_transformers_sequence_bias(engine, path, bias):
    prompt = random_prompts([10], seed=6)[0]
    token = hf_greedy(path, prompt, 1)[0] if bias < 0 else 17
    want = hf_greedy(path, prompt, 10, sequence_bias={(token,): bias})
    out = engine.generate([prompt], greedy(10, logit_bias={str(token): bias}))[0]  # JSON keys are strings
    assert out.token_ids == want
    if bias > 0:
        assert out.token_ids == [17] * 10


def test_allowed_token_ids_equal_transformers_prefix_allowed_tokens(engine, path):
    prompt = random_prompts([7], seed=8)[0]
    allowed = [5, 9, 40, 41, 200]
    want = hf_greedy(path, prompt, 12, prefix_allowed_tokens_fn=lambda batch, ids: allowed)
    out = engine.generate([prompt], greedy(12, allowed_token_ids=allowed))[0]
    assert out.token_ids == want
    assert set(out.token_ids) <= set(allowed)


def test_bad_words_equal_transformers_bad_words_ids(engine, path, monkeypatch):
    """A two-token bad word taken from the unconstrained output (its second token is banned right after its first;
    asynchronous steps check that first token on the device, where it still is) and a one-token bad word."""
    prompt = random_prompts([12], seed=9)[0]
    free = hf_greedy(path, prompt, 14)
    two, one = [free[3], free[4]], [free[8]]
    want = hf_greedy(path, prompt, 14, bad_words_ids=[two, one])
    text = [engine.tokenizer.decode(two), engine.tokenizer.decode(one)]
    checked_on_device = []
    apply = LogitEdits.apply
    monkeypatch.setattr(LogitEdits, "apply", lambda self, *a: (checked_on_device.append(self.conditional),
                                                               apply(self, *a)))
    out = engine.generate([prompt], greedy(14, bad_words=text))[0]
    assert want != free
    assert out.token_ids == want
    assert any(checked_on_device) == engine.async_pipeline


def test_truncate_prompt_tokens_keeps_the_last_tokens(engine, path):
    prompt = random_prompts([30], seed=10)[0]
    want = hf_greedy(path, prompt[-8:], 6)
    out = engine.generate([prompt], greedy(6, truncate_prompt_tokens=8))[0]
    assert out.num_prompt_tokens == 8
    assert out.token_ids == want


@pytest.mark.parametrize("values,message", [
    ({"n": 0}, "n must be in [1, 64]"), ({"n": 65}, "n must be in [1, 64]"),
    ({"logit_bias": {"x": 1.0}}, "logit_bias keys must be token ids"),
    ({"logit_bias": {"3": "big"}}, "logit_bias[3] must be a finite number"),
    ({"allowed_token_ids": [1, -2]}, "allowed_token_ids must be a list of non-negative integers"),
    ({"bad_words": [""]}, "bad_words must be a string or a list of non-empty strings"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens must be >= 1"),
])
def test_bad_values_are_refused_with_the_field(values, message):
    with pytest.raises(ValueError) as err:
        SamplingParams.from_dict(values)
    assert message in str(err.value)


def test_token_ids_outside_the_vocabulary_are_refused(engine):
    for key, value in (("allowed_token_ids", [10**6]), ("logit_bias", {10**6: 1.0})):
        with pytest.raises(ValueError, match=f"{key}: 1000000 is outside the vocabulary"):
            engine.generate([[1, 2, 3]], SamplingParams(**{key: value}))


def test_logit_bias_is_clamped_to_100():
    assert SamplingParams(logit_bias={3: 1e9, 4: -1e9}).logit_bias == {3: 100.0, 4: -100.0}


def test_row_logit_edits_follow_rows_leaving_and_joining_and_read_only_the_joining_ones():
    """The decode rows' fixed edits (logit_bias, one-token bad words, allowed sets) are kept per row: after rows leave
    and join, the gathered edits equal a fresh read of every row, and only the joining requests were read; the moving
    edits (min_tokens bans, bad words of several tokens) follow each row's tokens."""
    import numpy as np

    from backend.core.running_batch import RunningBatch
    from backend.executor import logit_rules
    from backend.request import Request

    def request(i):
        kinds = [dict(logit_bias={5 + i: 2.5, 40: -1.0}), dict(), dict(allowed_token_ids=[1, 2, 3 + i]),
                 dict(min_tokens=8), dict(logit_bias={7: 1.0})]
        req = Request(f"r{i}", [3] * (4 + i), SamplingParams(max_tokens=50, **kinds[i % 5]), seed=i,
                      eos_token_ids=frozenset({2}))
        if i % 5 == 1:  # bad words: one of one token, one of two whose first token the request just made
            req.bad_word_ids, req.edits_logits = [[11 + i], [9, 10]], True
        req.output_token_ids = [4, 9]  # both read: this step feeds the 9 and samples the next token
        req.num_computed_tokens = req.num_prompt_tokens + 2
        req.num_tokens = req.num_prompt_tokens + 3
        req.block_ids = [i + 1]
        return req

    def gathered(kept, rb):
        lists = logit_rules.EditLists.empty()
        kept.gather(rb, lists)
        edits = sorted(zip(lists.rows, lists.tokens, lists.values, lists.when))
        return edits, sorted(zip(lists.allowed_rows, lists.allowed_tokens)), sorted(lists.restricted)

    rb = RunningBatch(block_size=16, max_model_len=256, max_blocks=8)
    rb._append([request(i) for i in range(6)], np.arange(6))
    kept = logit_rules.RowLogitEdits()
    first = gathered(kept, rb)
    ban = float("-inf")
    assert first[0] == [(0, 5, 2.5, -1), (0, 40, -1.0, -1), (1, 10, ban, -1), (1, 12, ban, -1), (3, 2, ban, -1),
                        (4, 7, 1.0, -1), (5, 10, 2.5, -1), (5, 40, -1.0, -1)]
    assert first[1] == [(2, 1), (2, 2), (2, 5)] and first[2] == [2]
    rb._delete(np.array([0, 2]))
    reads = []
    real = logit_rules.fixed_edits
    logit_rules.fixed_edits = lambda req: reads.append(req.request_id) or real(req)
    try:
        rb._append([request(6), request(7)], np.array([0, 1]))
        got = gathered(kept, rb)
    finally:
        logit_rules.fixed_edits = real
    assert reads == ["r6", "r7"]
    assert [r.request_id for r in rb.requests] == ["r4", "r1", "r5", "r3", "r6", "r7"]  # holes taken by the last
    assert got == gathered(logit_rules.RowLogitEdits(), rb)  # a fresh read of every row
    assert got[2] == [5]  # r7 (allowed set) is row 5 now
