"""The engine with an FP8 KV cache on CUDA: the greedy tokens of transformers reading the same e4m3-rounded K/V
(tests/unit/models/test_fp8_kv_cache.py's reference), on the torch and the Triton path, eager and sync, and with graphs
and the async pipeline (the fused rope decode kernel, splits, kv_scale read by captured kernels)."""
from __future__ import annotations

import pytest
import torch

from backend import Engine, EngineConfig, SamplingParams
from backend.models import load_model
from backend.ops import fp8
from tests.tiny_models import build_tiny, kv_blocks_used_after_settling, random_prompts, word_tokenizer
from tests.unit.models.test_fp8_kv_cache import LAYER_SCALES, hf_greedy_e4m3, with_kv_scales

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("attention", ["torch", "triton"])
def test_tiny_greedy_equals_transformers_reading_an_e4m3_cache(tmp_path_factory, attention):
    path = build_tiny("llama", str(tmp_path_factory.mktemp("tiny-fp8-gpu")))
    prompts = random_prompts([3, 30, 9, 57, 1, 16, 22, 5, 40, 2], seed=2)
    want = [hf_greedy_e4m3(path, p, 48, LAYER_SCALES) for p in prompts]
    for async_pipeline, graphs in ((False, False), (True, True)):
        model = with_kv_scales(load_model(path, dtype=torch.float32, device="cuda", attention_backend=attention),
                               LAYER_SCALES)
        engine = Engine(EngineConfig(model=path, device="cuda", dtype="float32", num_kv_blocks=256, block_size=16,
                                     max_num_seqs=32, max_num_batched_tokens=256, kv_cache_dtype="fp8",
                                     async_pipeline=async_pipeline, cuda_graphs=graphs),
                        model=model, tokenizer=word_tokenizer())
        try:
            assert engine.runner.kv_cache.dtype == fp8.FP8_DTYPE and engine.parts.model.ops.name == attention
            outs = engine.generate(prompts, SamplingParams(max_tokens=48, temperature=0, ignore_eos=True))
            assert [o.token_ids for o in outs] == want, (async_pipeline, graphs)
            assert kv_blocks_used_after_settling(engine) == 0
        finally:
            engine.shutdown()
