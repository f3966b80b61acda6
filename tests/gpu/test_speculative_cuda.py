"""Speculative decoding on CUDA: drafted steps (eager, several tokens a row) between graph-captured one-token steps
give the outputs of the engine without speculation (greedy and seeded sampling, float32; the async pipeline with the
draft policy too), and on the random 1B shape in bf16 the n-gram proposer and a draft model draft and give every KV
block back."""
from __future__ import annotations

import pytest

from backend import Engine, EngineConfig, SamplingParams
from tests.tiny_models import build_tiny, kv_blocks_used_after_settling, random_prompts
from tests.unit.speculative.test_adaptive_speculation import _run as _run_async
from tests.unit.speculative.test_engine_speculation import OracleProposer, _equal_with_oracle, _reference, _summary

pytestmark = pytest.mark.gpu
CUDA = dict(device="cuda", dtype="float32")


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return build_tiny("llama", str(tmp_path_factory.mktemp("tiny")))


def test_greedy_outputs_equal_on_cuda(path):
    prompts = random_prompts([3, 30, 9, 57, 1, 16])
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (12, 20, 7, 16, 3, 25)]
    counts, _ = _equal_with_oracle(path, prompts, params, **CUDA)
    assert 0 < counts["spec_accepted_tokens"] < counts["spec_proposed_tokens"]


def test_seeded_sampling_and_logprobs_equal_on_cuda(path):
    prompts = random_prompts([5, 11, 23, 2], seed=3)
    params = [SamplingParams(max_tokens=18, temperature=0.8, top_p=0.9, top_k=40, seed=s, logprobs=2,
                             ignore_eos=True) for s in (1, 2, 3, 4)]
    counts, _ = _equal_with_oracle(path, prompts, params, num_speculative_tokens=3, **CUDA)
    assert counts["spec_accepted_tokens"] > 0


def test_async_pipeline_with_the_draft_policy_on_cuda(path):
    """Drafted steps between carried-over graph steps (the step in flight read first): outputs unchanged."""
    prompts = random_prompts([3, 30, 9, 57, 1, 16], seed=21)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (40, 33, 7, 26, 3, 45)]
    want, _, _ = _run_async(path, prompts, params, **CUDA)
    oracle = OracleProposer(_reference(path, prompts, params))
    got, counts, _ = _run_async(path, prompts, params, oracle, **CUDA)
    assert _summary(got) == _summary(want)
    assert counts["spec_accepted_tokens"] > 0


def test_ngram_on_the_1b_shape_in_bf16():
    """Prompts that repeat a phrase, so n-gram matches, every row drafting at every step (the policy off: random
    weights' outputs rarely keep a draft); lengths exact and every block returned."""
    engine = Engine(EngineConfig(model="random:llama-3.2-1b", device="cuda", dtype="bfloat16", max_model_len=512,
                                 num_kv_blocks=256, max_num_seqs=16, speculative_method="ngram",
                                 speculative_adaptive=False))
    try:
        prompts = [list(range(100 + i, 116 + i)) * 6 for i in range(12)]
        outs = engine.generate(prompts, SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
        counts = engine.speculator.counts()
        assert [len(o.token_ids) for o in outs] == [64] * 12
        assert counts["spec_steps"] > 0 and counts["spec_proposed_tokens"] > 0
        assert kv_blocks_used_after_settling(engine) == 0
    finally:
        engine.shutdown()


def test_constrained_rows_draft_on_cuda():
    """Regex and choice rows drafting (n-gram over prompts that repeat an allowed text) beside free rows on the 1B
    shape, async pipeline with the policy: every constrained output fits, every block returns."""
    import re

    pytest.importorskip("llguidance")
    engine = Engine(EngineConfig(model="random:llama-3.2-1b", device="cuda", dtype="bfloat16", max_model_len=512,
                                 num_kv_blocks=256, max_num_seqs=16, speculative_method="ngram"))
    try:
        regex, choices = r"(ab-[0-9]{2} ){3,6}", ["alpha beta gamma", "delta"]
        prompts = ["ab-12 ab-34 ab-56 ab-78 " * 4] * 6 + ["alpha beta gamma " * 6] * 6 + ["free text " * 8] * 4
        kinds = [{"regex": regex}] * 6 + [{"choice": choices}] * 6 + [None] * 4
        params = [SamplingParams(max_tokens=64, temperature=0.0, structured_outputs=k) for k in kinds]
        outs = engine.generate(prompts, params)
        assert all(re.fullmatch(regex, o.text) for o in outs[:6]), [o.text for o in outs[:6]]
        assert all(o.text in choices for o in outs[6:12])
        assert kv_blocks_used_after_settling(engine) == 0
    finally:
        engine.shutdown()


def test_draft_model_on_cuda(path):
    """The model as its own draft on CUDA (graphs on for the one-token steps, the async pipeline with the policy):
    outputs equal to the engine alone, every draft kept, both caches' blocks back."""
    prompts = random_prompts([3, 30, 9, 57, 1, 16], seed=22)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (40, 33, 7, 26, 3, 45)]
    settings = dict(model=path, block_size=4, num_kv_blocks=96, max_num_seqs=16, **CUDA)
    outs = {}
    for method in ("", "draft"):
        extra = dict(speculative_method="draft", speculative_draft_model=path) if method else {}
        engine = Engine(EngineConfig(**settings, **extra))
        try:
            outs[method] = [o.token_ids for o in engine.generate(prompts, params)]
            assert kv_blocks_used_after_settling(engine) == 0
            if method:
                counts = engine.speculator.counts()
                cache = engine.speculator.proposer.cache
                assert counts["spec_accepted_tokens"] == counts["spec_proposed_tokens"] > 0
                assert len(cache) == 0 and cache.num_free_blocks == cache.num_blocks - 1
        finally:
            engine.shutdown()
    assert outs["draft"] == outs[""]


def test_draft_model_on_the_1b_shape_in_bf16():
    """random:llama-3.2-1b drafting for itself in bf16 (Triton attention and GEMMs in the draft's forwards):
    lengths exact, drafts kept (bf16 near-ties may part the two forwards' argmax), every block back."""
    engine = Engine(EngineConfig(model="random:llama-3.2-1b", device="cuda", dtype="bfloat16", max_model_len=512,
                                 num_kv_blocks=256, max_num_seqs=16, speculative_method="draft",
                                 speculative_draft_model="random:llama-3.2-1b", speculative_adaptive=False))
    try:
        prompts = [list(range(100 + i, 164 + i)) for i in range(12)]
        outs = engine.generate(prompts, SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True))
        counts = engine.speculator.counts()
        assert [len(o.token_ids) for o in outs] == [48] * 12
        assert counts["spec_proposed_tokens"] >= counts["spec_accepted_tokens"] > 0
        assert kv_blocks_used_after_settling(engine) == 0
    finally:
        engine.shutdown()
