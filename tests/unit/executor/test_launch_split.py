"""A step's forward and its sampling are two launches: the loop may read the step before and do per-row host work
between them (sample_after_previous), and every token is the same as with the two launched back to back."""
from __future__ import annotations

import pytest

from backend import Engine, EngineConfig, SamplingParams
from backend.executor.packer import SlotPacker
from tests.tiny_models import build_tiny, hf_greedy, kv_blocks_used_after_settling, random_prompts

MODES = [pytest.param(False, id="sync"), pytest.param(True, id="async")]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tiny-launch"))


def _params():
    return [
        SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.9, top_k=20, seed=5, ignore_eos=True),
        SamplingParams(max_tokens=18, temperature=0.0, logprobs=2, ignore_eos=True),
        SamplingParams(max_tokens=22, temperature=0.0, frequency_penalty=1.5, ignore_eos=True),
        SamplingParams(max_tokens=16, temperature=0.7, top_p=0.8, seed=9, min_tokens=4, ignore_eos=True),
        SamplingParams(max_tokens=26, temperature=0.0, ignore_eos=True),
    ]


def _run(path, async_pipeline, deferred, monkeypatch):
    """Outputs of six requests with three seats (rows leave and join); deferred: every step's sampling is queued
    after the step before was read and updated. Returns (outputs, steps whose sampling was deferred)."""
    deferred_steps = []
    if deferred:
        pack = SlotPacker.pack

        def pack_deferred(self, batch, prev):
            st = pack(self, batch, prev)
            st.sample_after_previous = True
            deferred_steps.append(batch.step_id)
            return st

        monkeypatch.setattr(SlotPacker, "pack", pack_deferred)
    engine = Engine(EngineConfig(model=path, device="cpu", num_kv_blocks=200, block_size=4, max_num_seqs=3,
                                 max_num_batched_tokens=16, async_pipeline=async_pipeline))
    try:
        outs = engine.generate(random_prompts([7, 12, 5, 9, 14, 6], seed=91), _params())
        assert kv_blocks_used_after_settling(engine) == 0
        return outs, deferred_steps
    finally:
        engine.shutdown()
        monkeypatch.undo()


@pytest.mark.parametrize("async_pipeline", MODES)
def test_sampling_queued_after_the_step_before_is_read_gives_the_same_tokens(root, async_pipeline, monkeypatch):
    path = build_tiny("llama", root)
    plain, _ = _run(path, async_pipeline, False, monkeypatch)
    split, deferred_steps = _run(path, async_pipeline, True, monkeypatch)
    assert len(deferred_steps) > 20
    assert [o.token_ids for o in split] == [o.token_ids for o in plain]
    assert [len(o.token_ids) for o in split] == [p.max_tokens for p in _params()]
    prompts = random_prompts([7, 12, 5, 9, 14, 6], seed=91)
    for i in (0, 2, 5):  # the plain greedy rows, as transformers decodes them
        assert split[i].token_ids == hf_greedy(path, prompts[i], _params()[i].max_tokens)
    assert [lp["token_id"] for lp in split[2].logprobs] == split[2].token_ids  # one per token, for the greedy
    assert all(lp["rank"] == 1 and len(lp["top_logprobs"]) == 2 for lp in split[2].logprobs)  # row with logprobs
    assert split[2].logprobs == plain[2].logprobs
