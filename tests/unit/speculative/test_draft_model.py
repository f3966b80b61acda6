"""Draft-model speculation: the draft cache's bookkeeping, the draft proposer's tokens against transformers' greedy
continuation of the draft model (also after drafts were rejected and its cache rolled back), and the engine with a
draft model: outputs equal to the engine alone, every KV block of both caches back, settings checked."""
from __future__ import annotations

import shutil

import pytest
import torch

from backend import Engine, EngineConfig, SamplingParams
from backend.models import load_model
from backend.speculative.draft_cache import DraftCache
from backend.speculative.draft_model import DraftModelProposer
from backend.speculative.token_history import TokenHistory
from tests.tiny_models import (VOCAB, build_tiny, byte_level_bpe, hf_greedy, kv_blocks_used_after_settling,
                               random_prompts, tiny_engine)

SETTINGS = dict(num_kv_blocks=96, max_num_batched_tokens=32, speculative_adaptive=False)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return build_tiny("llama", str(tmp_path_factory.mktemp("tiny-target")))


@pytest.fixture(scope="module")
def other(tmp_path_factory):
    """Another tiny Llama with the same tokenizer but other weights: its drafts are often wrong."""
    return build_tiny("llama", str(tmp_path_factory.mktemp("tiny-draft")), seed=1)


def _proposer(path, num_blocks=64, block_size=4, k=4):
    model = load_model(path)
    kv = torch.zeros(model.spec.kv_cache_shape(num_blocks, block_size))
    return DraftModelProposer(model, kv, block_size, VOCAB, k, max_rows=8)


def _draft(proposer, histories, ks):
    proposer.prepare(histories, ks)
    return [proposer.propose(h, k) for h, k in zip(histories, ks)]


# ---- the cache -----------------------------------------------------------------------------------------------------
def test_cache_keeps_the_history_and_the_drafts_it_agrees_with():
    cache = DraftCache(num_blocks=8, block_size=4)
    h = TokenHistory([5, 6, 7])
    assert cache.reconcile(h) == 0
    assert cache.reserve([h], [3 + 3]) == [True] and cache.blocks(h) == [1, 2]
    cache.written(h, [8, 9, 10])  # the history's 3 tokens and 3 drafts are in the cache
    h.extend([8, 9, 4])  # two drafts kept, the third replaced
    assert cache.reconcile(h) == 5
    h.extend([11])
    assert cache.reconcile(h) == 5  # nothing past what was confirmed
    h2 = TokenHistory([1, 2])
    cache.reserve([h2], [2])
    cache.written(h2, [])
    assert cache.reconcile(h2) == 1  # all of it held: the last token is fed again, for its logits


def test_cache_evicts_the_least_recently_fed_and_never_lends_block_zero():
    cache = DraftCache(num_blocks=5, block_size=4)  # blocks 1..4
    a, b, c = TokenHistory([1] * 7), TokenHistory([2] * 7), TokenHistory([3] * 7)
    assert cache.reserve([a], [8]) == [True]
    assert cache.reserve([b], [8]) == [True] and cache.num_free_blocks == 0
    assert cache.reserve([c], [8]) == [True]  # a, fed longest ago, gave its blocks
    assert len(cache) == 2 and cache.reconcile(a) == 0 and 0 not in cache.blocks(b) + cache.blocks(c)
    assert cache.reserve([b, c, a], [8, 8, 8]) == [True, True, False]  # the step's own rows are never evicted
    cache.clear()
    assert cache.num_free_blocks == 4 and len(cache) == 0


# ---- the proposer --------------------------------------------------------------------------------------------------
def test_drafts_are_the_draft_models_greedy_tokens(other):
    proposer = _proposer(other)
    prompts = random_prompts([2, 6, 13, 30, 1], seed=5)
    histories = [TokenHistory(p) for p in prompts]
    got = _draft(proposer, histories, [4, 1, 3, 4, 4])
    assert got[:4] == [hf_greedy(other, p, k) for p, k in zip(prompts, [4, 1, 3, 4])]
    assert got[4] == []  # a single token: it drafts once it has two
    assert proposer.catch_ups == 1  # one eager forward for the three rows with more than two tokens to feed


def test_rejected_drafts_roll_back(other):
    """The next step's history keeps some drafts and replaces the rest: the proposals are still the draft model's
    greedy continuation of the history, as if it ran from scratch."""
    proposer = _proposer(other)
    prompts = random_prompts([9, 4, 17], seed=6)
    histories = [TokenHistory(p) for p in prompts]
    for step in range(6):
        drafts = _draft(proposer, histories, [4, 4, 4])
        for row, (h, d) in enumerate(zip(histories, drafts)):
            assert d == hf_greedy(other, h.tokens.tolist(), 4), (step, row)
            kept = (step + row) % 5  # 0..4 drafts kept, then a token of another choice
            h.extend(d[:kept] + ([(d[kept] + 1) % VOCAB] if kept < 4 else []))
        if step == 2:  # a row the policy paused for a few steps falls behind, then catches up
            histories[1].extend([7, 8, 9, 10])
    assert proposer.catch_ups == 2
    for h in histories:
        proposer.finished(h, 0)
    assert proposer.cache.num_free_blocks == proposer.cache.num_blocks - 1


def test_rows_that_do_not_fit_propose_nothing(other):
    proposer = _proposer(other, num_blocks=4, block_size=4)  # 3 blocks: 12 positions
    short, long = TokenHistory([3, 4]), TokenHistory(list(range(2, 14)))  # 5 and 15 positions with the drafts
    got = _draft(proposer, [short, long], [4, 4])
    assert got[0] == hf_greedy(other, [3, 4], 4) and got[1] == []


# ---- the engine ----------------------------------------------------------------------------------------------------
def _generate(path, prompts, params, draft="", **settings):
    extra = dict(speculative_method="draft", speculative_draft_model=draft) if draft else {}
    engine = tiny_engine(path, False, **{**SETTINGS, **extra, **settings})
    try:
        outs = engine.generate(prompts, params)
        assert kv_blocks_used_after_settling(engine) == 0
        counts = None
        if draft:
            counts = engine.speculator.counts()
            cache = engine.speculator.proposer.cache
            assert len(cache) == 0 and cache.num_free_blocks == cache.num_blocks - 1  # every draft block back
        return [(o.token_ids, o.finish_reason) for o in outs], counts
    finally:
        engine.shutdown()


def test_the_model_as_its_own_draft_keeps_every_draft(target):
    prompts = random_prompts([3, 30, 9, 17], seed=2)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (12, 20, 7, 16)]
    want, _ = _generate(target, prompts, params)
    got, counts = _generate(target, prompts, params, draft=target)
    assert got == want
    assert counts["spec_proposed_tokens"] > 0 and counts["spec_accepted_tokens"] == counts["spec_proposed_tokens"]


@pytest.mark.parametrize("sampled", [False, True])
def test_another_draft_keeps_outputs_equal(target, other, sampled):
    prompts = random_prompts([5, 11, 23, 2, 40], seed=3)
    params = [SamplingParams(max_tokens=18, temperature=0.8 if sampled else 0.0, top_k=40, seed=s, ignore_eos=True)
              for s in range(5)]
    want, _ = _generate(target, prompts, params)
    got, counts = _generate(target, prompts, params, draft=other, num_speculative_tokens=3)
    assert got == want
    assert counts["spec_proposed_tokens"] > 0


def test_preemption_and_n_keep_outputs_equal(target, other):
    prompts = random_prompts([20, 18, 25, 22], seed=4)
    params = [SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)] * 3 + [
        SamplingParams(max_tokens=12, temperature=1.0, n=3, seed=9, ignore_eos=True)]
    want, _ = _generate(target, prompts, params, num_kv_blocks=40)
    engine = tiny_engine(target, False, **{**SETTINGS, "num_kv_blocks": 40, "speculative_method": "draft",
                                           "speculative_draft_model": other})
    try:
        got = [(o.token_ids, o.finish_reason) for o in engine.generate(prompts, params)]
        assert engine.stats()["preemptions"] > 0
        assert kv_blocks_used_after_settling(engine) == 0
    finally:
        engine.shutdown()
    assert got == want


def test_settings_are_checked(target, tmp_path):
    with pytest.raises(ValueError, match="speculative_draft_model"):
        EngineConfig(model=target, speculative_method="draft").validate()
    with pytest.raises(ValueError, match="speculative_draft_model"):
        EngineConfig(model=target, speculative_method="ngram", speculative_draft_model=target).validate()
    foreign = tmp_path / "foreign"
    shutil.copytree(target, foreign)
    byte_level_bpe(["a few words of text", "and some more"], 300, "</s>").save_pretrained(foreign)
    with pytest.raises(ValueError, match="another tokenizer than the model"):
        tiny_engine(target, False, speculative_method="draft", speculative_draft_model=str(foreign))


def test_default_model_drafting_for_itself():
    """SmolLM2 on the CPU with itself as the draft: greedy output equal, every draft kept."""
    settings = dict(device="cpu", num_kv_blocks=128, max_num_seqs=4, speculative_adaptive=False)
    plain = Engine(EngineConfig(**settings))
    spec = Engine(EngineConfig(**settings, speculative_method="draft",
                               speculative_draft_model="smollm2-135m-instruct"), model=plain.parts.model,
                  tokenizer=plain.tokenizer)
    try:
        params = SamplingParams(max_tokens=20, temperature=0.0)
        prompt = "Name three primary colours."
        want, got = plain.generate([prompt], params)[0], spec.generate([prompt], params)[0]
        assert got.token_ids == want.token_ids
        counts = spec.speculator.counts()
        assert counts["spec_proposed_tokens"] > 0 and counts["spec_accepted_tokens"] == counts["spec_proposed_tokens"]
    finally:
        spec.shutdown()
        plain.shutdown()
