"""The engine on CUDA: parity with transformers, async == sync == eager, graph memory, a long run under load."""
from __future__ import annotations

import pytest
import torch

from backend import Engine, EngineConfig, SamplingParams
from tests.tiny_models import build_tiny, hf_greedy, random_prompts

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tiny-gpu"))


def run(path, prompts, n, **kw):
    settings = dict(model=path, device="cuda", dtype="float32", num_kv_blocks=256, block_size=16,
                    max_num_seqs=32, max_num_batched_tokens=256)
    settings.update(kw)
    engine = Engine(EngineConfig(**settings))
    try:
        outs = engine.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        return [o.token_ids for o in outs], engine
    finally:
        engine.shutdown()


@pytest.mark.parametrize("attention", ["torch", "triton"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_tiny_greedy_equals_transformers(root, family, attention):
    path = build_tiny(family, root)
    prompts = random_prompts([3, 30, 9, 57, 1, 16, 22, 5, 40, 2], seed=2)
    want = [hf_greedy(path, p, 64) for p in prompts]
    for async_pipeline in (False, True):
        for graphs in (False, True):
            got, _ = run(path, prompts, 64, async_pipeline=async_pipeline, cuda_graphs=graphs,
                         attention_backend=attention)
            assert got == want, (async_pipeline, graphs)


def test_two_slots_graph_memory(root):
    path = build_tiny("llama", root)
    engine = Engine(EngineConfig(model=path, device="cuda", dtype="float32", num_kv_blocks=256,
                                 max_num_seqs=64, max_num_batched_tokens=256))
    try:
        mem = engine.runner.graphs.memory
        one, both = mem["after_slot0"], mem["after_slot1"]
        print(f"graph pool: one slot {one / 1e6:.1f} MB, both slots {both / 1e6:.1f} MB")
        assert both <= 1.1 * one + (2 << 20)
    finally:
        engine.shutdown()


def test_long_run_async_equals_sync_under_load(root):
    """Many requests joining and leaving over a long run: any slot race would change tokens."""
    path = build_tiny("qwen2", root)
    prompts = random_prompts([(13 * i) % 90 + 1 for i in range(96)], seed=5)
    sync, _ = run(path, prompts, 200, async_pipeline=False, max_num_seqs=24)
    for _ in range(3):
        got, _ = run(path, prompts, 200, async_pipeline=True, max_num_seqs=24)
        assert got == sync


def test_8b_shape_async_equals_sync():
    """Llama-3-8B shape, random bf16 weights, first 64 tokens: async equals sync, with graphs and without.

    Graph and eager decode are compared by their first token only: in bf16 their reductions differ (the
    graph's attention splits over the static context bound, its GEMMs have the padded row count), and random
    weights give near-flat logits where one rounding flips a later token. Exact graph == eager is tested in
    float32 on the tiny models above.
    """
    prompts = [list(range(10 + i, 138 + i)) for i in range(8)]
    kw = dict(model="random:llama-3-8b", dtype="bfloat16", max_model_len=512, num_kv_blocks=512, max_num_seqs=8)
    eager_sync, _ = run(None, prompts, 64, async_pipeline=False, cuda_graphs=False, **kw)
    eager_async, _ = run(None, prompts, 64, async_pipeline=True, cuda_graphs=False, **kw)
    graph_sync, _ = run(None, prompts, 64, async_pipeline=False, cuda_graphs=True, **kw)
    graph_async, _ = run(None, prompts, 64, async_pipeline=True, cuda_graphs=True, **kw)
    assert eager_async == eager_sync
    assert graph_async == graph_sync
    assert [g[0] for g in graph_sync] == [e[0] for e in eager_sync]
    agree = sum(a == b for g, e in zip(graph_sync, eager_sync) for a, b in zip(g, e)) / (64 * len(prompts))
    print(f"graph vs eager token agreement over 64 tokens: {agree:.3f}")
    torch.cuda.empty_cache()


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="programmatic dependent launch needs compute capability 9.0")
@pytest.mark.parametrize("linear_backend,num_requests", [("auto", 12), ("triton", 12), ("auto", 32)])
def test_dependent_launch_gives_the_same_tokens(linear_backend, num_requests):
    """Llama-3.2-1B shape, random bf16 weights: the same kernels launched as programmatic dependents give the
    same tokens, bit for bit, in both pipeline modes (linear_backend=triton: every decode GEMM is a Triton
    kernel too, so whole layers run as one chain of dependents). 12 and 32 requests: the H200 tables' 16- and
    32-row entries (parked qkv, o and down; gate_up fused with SiLU-and-mul)."""
    prompts = [list(range(20 + 7 * i, 84 + 7 * i)) for i in range(num_requests)]
    kw = dict(model="random:llama-3.2-1b", dtype="bfloat16", max_model_len=256, num_kv_blocks=256,
              max_num_seqs=num_requests, linear_backend=linear_backend)

    def tokens(**settings):
        engine = Engine(EngineConfig(**kw, **settings))
        try:
            ops = engine.parts.model.ops.name
            outs = engine.generate(prompts, SamplingParams(max_tokens=48, temperature=0, ignore_eos=True))
            return [o.token_ids for o in outs], ops
        finally:
            engine.shutdown()

    want, ops = tokens(dependent_launch="off")
    assert ops == "triton"
    for async_pipeline in (False, True):
        got, ops = tokens(dependent_launch="on", async_pipeline=async_pipeline)
        assert ops == "triton+pdl"
        assert got == want, async_pipeline
    torch.cuda.empty_cache()


def test_logprobs_and_ranks(root):
    """Logprobs on CUDA (decode graphs, async pipeline): a greedy token ranks 1 and heads its top-n; a sampled token
    ranks one past the top-n entries more likely than it, exactly so where it is among them."""
    path = build_tiny("llama", root)
    prompts = random_prompts([5, 17, 9], seed=4)

    def logprobs(temperature):
        engine = Engine(EngineConfig(model=path, device="cuda", dtype="float32", num_kv_blocks=256, max_num_seqs=8,
                                     async_pipeline=True, cuda_graphs=True))
        try:
            params = SamplingParams(max_tokens=12, temperature=temperature, seed=11, logprobs=3, ignore_eos=True)
            return [o.logprobs for o in engine.generate(prompts, params)]
        finally:
            engine.shutdown()

    greedy = [e for out in logprobs(0) for e in out]
    assert len(greedy) == 36
    assert all(e["rank"] == 1 and e["top_logprobs"][0]["token_id"] == e["token_id"] for e in greedy)
    sampled = [e for out in logprobs(1.5) for e in out]
    assert len(sampled) == 36 and any(e["rank"] > 1 for e in sampled)
    for e in sampled:
        above = sum(t["logprob"] > e["logprob"] for t in e["top_logprobs"])
        assert e["rank"] >= above + 1
        if any(t["token_id"] == e["token_id"] for t in e["top_logprobs"]):
            assert e["rank"] == above + 1


def test_samples_and_logit_rules_through_decode_graphs(root):
    """On CUDA (decode graphs, async pipeline): n = 4 greedy samples share the prompt's blocks and equal
    transformers; seeded samples equal lone requests seeded seed + i; logit_bias, allowed_token_ids and a
    two-token bad word (checked on the device against the carried-over token) equal transformers' processors."""
    path = build_tiny("llama", root)
    prompt = random_prompts([37], seed=12)[0]
    free = hf_greedy(path, prompt, 16)
    engine = Engine(EngineConfig(model=path, device="cuda", dtype="float32", num_kv_blocks=256, block_size=16,
                                 max_num_seqs=8, async_pipeline=True, cuda_graphs=True))
    try:
        greedy = dict(max_tokens=16, temperature=0.0, ignore_eos=True)
        outs = engine.generate([prompt], SamplingParams(n=4, **greedy))
        assert [o.token_ids for o in outs] == [free] * 4
        assert [o.num_cached_tokens for o in outs] == [0, 32, 32, 32]
        sampled = dict(max_tokens=16, temperature=1.0, top_k=50, ignore_eos=True)
        outs = engine.generate([prompt], SamplingParams(n=4, seed=5, **sampled))
        singles = engine.generate([prompt] * 4, [SamplingParams(seed=5 + i, **sampled) for i in range(4)])
        assert [o.token_ids for o in outs] == [s.token_ids for s in singles]
        bias = engine.generate([prompt], SamplingParams(logit_bias={free[0]: -100.0}, **greedy))[0]
        assert bias.token_ids == hf_greedy(path, prompt, 16, sequence_bias={(free[0],): -100.0})
        allowed = [3, 50, 70, 90]
        restricted = engine.generate([prompt], SamplingParams(allowed_token_ids=allowed, **greedy))[0]
        assert restricted.token_ids == hf_greedy(path, prompt, 16, prefix_allowed_tokens_fn=lambda b, i: allowed)
        words = [free[5], free[6]]
        banned = engine.generate([prompt], SamplingParams(bad_words=[engine.tokenizer.decode(words)], **greedy))[0]
        assert banned.token_ids == hf_greedy(path, prompt, 16, bad_words_ids=[words]) != free
    finally:
        engine.shutdown()


def test_seeded_sampling_is_the_same_in_every_mode(root):
    """Top-p, top-k and min-p rows beside a greedy one (the fused sampler: its captured graph on decode steps, eager
    on the others): a seed gives the same tokens in sync and async mode, with and without CUDA graphs, and alone."""
    path = build_tiny("llama", root)
    prompts = random_prompts([5, 17, 9, 30], seed=21)
    kinds = [dict(temperature=0.8, top_p=0.9), dict(temperature=1.0, top_k=20),
             dict(temperature=0.7, top_p=0.95, min_p=0.1), dict(temperature=0.0)]
    params = [SamplingParams(max_tokens=24, seed=100 + i, ignore_eos=True, **kind) for i, kind in enumerate(kinds)]

    def tokens(prompts, params, **settings):
        engine = Engine(EngineConfig(model=path, device="cuda", dtype="float32", num_kv_blocks=256, max_num_seqs=8,
                                     **settings))
        try:
            return [o.token_ids for o in engine.generate(prompts, params)]
        finally:
            engine.shutdown()

    want = tokens(prompts, params, async_pipeline=True, cuda_graphs=True)
    assert tokens(prompts, params, async_pipeline=False, cuda_graphs=True) == want
    assert tokens(prompts, params, async_pipeline=True, cuda_graphs=False) == want
    assert [tokens([p], [q], async_pipeline=True, cuda_graphs=True)[0] for p, q in zip(prompts, params)] == want
    assert len({tuple(t) for t in want}) == 4


def test_steps_over_1024_tokens_replay_wide_mixed_graphs(root, monkeypatch):
    """Prompts that fill steps of 1,024-3,072 tokens beside decoding rows replay mixed graphs of the wide token buckets
    (1,536 up to 3,072 here), with transformers' greedy tokens."""
    from backend.executor.packer import SlotPacker

    mixed = []  # (tokens, bucket) of each step that replayed a mixed graph
    pad_mixed = SlotPacker.pad_mixed
    monkeypatch.setattr(SlotPacker, "pad_mixed", lambda self, slot, seqs, num_tokens, tokens, *rest: mixed.append(
        (num_tokens, tokens)) or pad_mixed(self, slot, seqs, num_tokens, tokens, *rest))
    path = build_tiny("llama", root)
    prompts = random_prompts([900, 3, 800, 700, 40, 650, 999, 500], seed=7)
    want = [hf_greedy(path, p, 16) for p in prompts]
    got, _ = run(path, prompts, 16, async_pipeline=True, cuda_graphs=True, attention_backend="triton",
                 num_kv_blocks=512, max_num_batched_tokens=3072, max_model_len=1024)
    assert got == want
    wide = {b for t, b in mixed if b > 1024}
    assert wide and wide <= {1536, 2048, 3072}, mixed
