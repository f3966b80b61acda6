"""The engine with an FP8 KV cache (kv_cache_dtype fp8) on tiny random models.

- Capacity: the KV tensor is e4m3 and the same byte budget holds as many more blocks as the model's element size
  is wider (twice for bf16, four times for float32); every block comes back once the requests finish.
- Stats: engine.stats() counts the fp8 cache's blocks (kv_blocks_used, kv_blocks_total, kv_usage) as they are held.
- Exactness, on the CPU's torch path: greedy tokens equal transformers' greedy generate whose KV cache rounds its
  keys and values through e4m3 the way ours stores them (quantize_kv by the layer's scale, then dequantize_kv),
  with a different scale in each layer; without that rounding transformers' tokens differ, so the test sees it.
- The Triton path, interpreted (as in tests/kernels/test_engine_triton_path.py), gives the torch path's tokens.

The capacity test lets the loader give each layer its kv_scale (1.0 for a checkpoint without scales); the others set
them by hand, a different pair in each layer, as a checkpoint's scales would be.
"""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from transformers import DynamicCache

from backend import Engine, EngineConfig, SamplingParams
from backend.models import load_model
from backend.ops import fp8
from tests.tiny_models import build_tiny, hf_model, kv_blocks_used_after_settling, random_prompts, word_tokenizer

# [k_scale, v_scale] of each layer of the tiny Llama: its keys and values reach about ±0.7 (tiny random weights),
# so these map the largest to about 300 of e4m3's ±448, each scale different so that a layer reading another's shows
LAYER_SCALES = [(0.0021, 0.0017), (0.0019, 0.0023)]
PROMPT_LENS = [3, 30, 9, 57, 1, 16, 22, 5]
NEW_TOKENS = [12, 20, 7, 16, 3, 20, 9, 14]


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    return build_tiny("llama", str(tmp_path_factory.mktemp("tiny-fp8-kv")))


def with_kv_scales(model, scales):
    """model with each layer's kv_scale set (a (2,) float32 parameter on the model's device), as the loader does."""
    for layer, pair in zip(model.layers, scales, strict=True):
        layer.kv_scale = nn.Parameter(torch.tensor(pair, dtype=torch.float32, device=model.embed_tokens.device),
                                      requires_grad=False)
    return model


def make_engine(path, model, **settings) -> Engine:
    # model None: the engine loads path itself
    config = dict(model=path, device="cpu", block_size=4, max_num_batched_tokens=24, max_num_seqs=16,
                  kv_cache_dtype="fp8")
    config.update(settings)
    return Engine(EngineConfig(**config), model=model, tokenizer=word_tokenizer())


def greedy(n):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("dtype,times", [("bfloat16", 2), ("float32", 4)])
def test_the_same_bytes_hold_more_blocks(llama, dtype, times):
    """kv_cache_cpu_bytes sized for 40 blocks of the model's dtype holds 40 × its element size of e4m3 blocks: the
    KV tensor takes the same bytes, and the engine reports the cache's dtype. The engines load the checkpoint
    themselves (the loader gives each layer its kv_scale)."""
    spec = load_model(llama).spec
    model_dtype = getattr(torch, dtype)
    budget = 40 * spec.kv_bytes_per_block(4, model_dtype)
    engines = {kv: make_engine(llama, None, dtype=dtype, kv_cache_dtype=kv, kv_cache_cpu_bytes=budget)
               for kv in ("auto", "fp8")}
    try:
        auto, fp8_engine = engines["auto"], engines["fp8"]
        assert auto.runner.kv_cache.dtype == auto.parts.kv_cache_dtype == model_dtype
        assert fp8_engine.runner.kv_cache.dtype == fp8_engine.parts.kv_cache_dtype == fp8.FP8_DTYPE
        assert auto.runner.kv_cache.shape[2] == 40
        assert fp8_engine.runner.kv_cache.shape[2] == 40 * times  # the block count, null block included
        assert fp8_engine.block_manager.num_usable_blocks == 40 * times - 1
        assert fp8_engine.runner.kv_cache.nbytes == auto.runner.kv_cache.nbytes == budget
        assert spec.kv_bytes_per_block(4, fp8.FP8_DTYPE) * times == spec.kv_bytes_per_block(4, model_dtype)
        outs = fp8_engine.generate(random_prompts([9, 30]), [greedy(5), greedy(5)])  # it serves
        assert [len(o.token_ids) for o in outs] == [5, 5]
        assert kv_blocks_used_after_settling(fp8_engine) == 0
    finally:
        for engine in engines.values():
            engine.shutdown()


@pytest.mark.parametrize("dtype,times", [("bfloat16", 2), ("float32", 4)])
def test_stats_report_the_fp8_cache_blocks_while_requests_hold_them(llama, dtype, times):
    """Snapshots of engine.stats() after every step, with the byte budget of 32 blocks of the model's dtype: the
    fp8 cache's kv_blocks_total is the block count it was sized to (32 × the element size, less the null block),
    its kv_blocks_used at each step is what the model-dtype cache holds at that step (blocks count tokens, not
    bytes), kv_usage is used / total, and every block is back once the requests finish."""
    model_dtype = getattr(torch, dtype)
    budget = 32 * load_model(llama).spec.kv_bytes_per_block(4, model_dtype)
    prompts, params = random_prompts([9, 30]), [greedy(20), greedy(14)]
    prompt_blocks = sum(-(-len(p) // 4) for p in prompts)
    seen = {}
    for kv in ("auto", "fp8"):
        engine = make_engine(llama, None, dtype=dtype, kv_cache_dtype=kv, kv_cache_cpu_bytes=budget,
                             async_pipeline=False, enable_prefix_caching=False)
        try:
            snapshots, refresh = [], engine.loop.refresh_stats

            def recording(refresh=refresh, engine=engine, snapshots=snapshots):
                refresh()
                snapshots.append(engine.stats())

            engine.loop.refresh_stats = recording
            engine.generate(prompts, params)
            assert kv_blocks_used_after_settling(engine) == 0
            final = engine.stats()
            assert (final["kv_blocks_used"], final["kv_usage"], final["running"]) == (0, 0.0, 0)
            sized = engine.runner.kv_cache.shape[2] - 1  # the blocks the cache holds, less the null block
            seen[kv] = [s["kv_blocks_used"] for s in snapshots if s["running"]]
            for s in snapshots:
                assert s["kv_blocks_total"] == sized
                assert s["kv_usage"] == pytest.approx(s["kv_blocks_used"] / sized, abs=1e-12)
        finally:
            engine.shutdown()
        assert sized == (32 * times if kv == "fp8" else 32) - 1
        assert max(seen[kv]) > prompt_blocks  # the snapshots saw the blocks grow past the prompts' as tokens came
    assert seen["fp8"] == seen["auto"]


def test_fp8_cache_needs_the_layers_scales(llama):
    with pytest.raises(ValueError, match="kv_scale"):
        make_engine(llama, load_model(llama), num_kv_blocks=32)


class _E4M3Cache(DynamicCache):
    """transformers' dynamic cache whose keys and values go through e4m3 as ours are stored: quantize_kv by the
    layer's scale, then dequantize_kv (attention reads the new token's K/V from the cache too, as ours does)."""

    def __init__(self, scales, **kw):
        super().__init__(**kw)
        self.scales = [torch.tensor(pair, dtype=torch.float32) for pair in scales]

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        s = self.scales[layer_idx]
        key_states = fp8.dequantize_kv(fp8.quantize_kv(key_states, s[0]), s[0], key_states.dtype)
        value_states = fp8.dequantize_kv(fp8.quantize_kv(value_states, s[1]), s[1], value_states.dtype)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


def hf_greedy_e4m3(path: str, prompt: list[int], new_tokens: int, scales) -> list[int]:
    """transformers' greedy generate (float32) reading K/V rounded through e4m3 (None: unrounded)."""
    model = hf_model(path)
    cache = _E4M3Cache(scales, config=model.config) if scales else None
    with torch.no_grad(), warnings.catch_warnings():
        # past_key_values: the name every transformers 5 takes (later ones call it cache, and warn)
        warnings.simplefilter("ignore", FutureWarning)
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long), past_key_values=cache,
                             eos_token_id=None)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("async_pipeline", [False, True], ids=["sync", "async"])
def test_greedy_equals_transformers_reading_an_e4m3_cache(llama, async_pipeline):
    """Mixed lengths, chunked prefill (prompts longer than the 24-token step), requests finishing at different
    steps, on the torch path: the tokens of transformers reading the same e4m3-rounded K/V, which differ from
    transformers' own somewhere; every KV block returned after."""
    prompts = random_prompts(PROMPT_LENS)
    want = [hf_greedy_e4m3(llama, p, n, LAYER_SCALES) for p, n in zip(prompts, NEW_TOKENS)]
    plain = [hf_greedy_e4m3(llama, p, n, None) for p, n in zip(prompts, NEW_TOKENS)]
    assert want != plain  # the rounding changes tokens: the comparison below can tell an unrounded cache
    engine = make_engine(llama, with_kv_scales(load_model(llama), LAYER_SCALES), num_kv_blocks=96,
                         async_pipeline=async_pipeline)
    try:
        assert engine.runner.kv_cache.dtype == fp8.FP8_DTYPE and engine.parts.model.ops.name == "torch"
        outs = engine.generate(prompts, [greedy(n) for n in NEW_TOKENS])
        assert [o.token_ids for o in outs] == want
        assert kv_blocks_used_after_settling(engine) == 0
    finally:
        engine.shutdown()


@pytest.mark.kernels
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter run; CUDA runs tests/kernels/test_fp8_kv.py")
def test_triton_path_equals_torch_path_with_an_fp8_cache(tmp_path_factory, monkeypatch):
    """The tiny Triton-path Llama (one layer) with an FP8 cache, interpreted: the torch path's greedy tokens, through
    prefill chunks, decode steps with the fused rope kernel (up to 8 sequences in the 4 'SMs'' one wave) and with
    rope_write_kv + the decode kernel, context splits and the reduce kernel."""
    from backend.ops.triton import attention as triton_attention, buffers

    monkeypatch.setattr(buffers, "sm_count", lambda device: 4)
    monkeypatch.setattr(triton_attention, "DECODE_MIN_SPLIT_TOKENS", 16)
    seen = set()
    kernel = triton_attention._decode_kernel

    class Spy:
        def __getitem__(self, grid):
            def run(*args, **kw):
                assert kw["KV_FP8"]
                seen.add((kw["ROPE"], kw["DIRECT"]))
                return kernel[grid](*args, **kw)
            return run

    monkeypatch.setattr(triton_attention, "_decode_kernel", Spy())
    path = build_tiny("llama-128", str(tmp_path_factory.mktemp("tiny-fp8-triton")), seed=1)
    prompts = random_prompts([30, 5, 17, 20, 3, 9, 24, 12, 7, 13], seed=3)
    params = [SamplingParams(max_tokens=2 + (i * 5) % 9, temperature=0, ignore_eos=True) for i in range(10)]
    tokens = {}
    for backend in ("torch", "triton"):
        model = with_kv_scales(load_model(path, dtype=torch.float16, attention_backend=backend), [(0.0023, 0.0019)])
        engine = make_engine(path, model, dtype="float16", num_kv_blocks=64, block_size=16,
                             max_num_batched_tokens=64, max_model_len=256, max_num_seqs=10)
        try:
            assert engine.parts.model.ops.name == backend
            tokens[backend] = [o.token_ids for o in engine.generate(prompts, params)]
            assert kv_blocks_used_after_settling(engine) == 0
        finally:
            engine.shutdown()
    assert tokens["triton"] == tokens["torch"]
    assert {(True, True), (True, False), (False, True)} <= seen, seen  # fused or not; one split or several
