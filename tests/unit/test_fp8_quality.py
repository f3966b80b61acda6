"""FP8 quality of the default model, a reduced python -m bench.quality through the engine's own settings
(quantization=fp8, kv_cache_dtype=fp8): perplexity against the baseline's and greedy agreement with its outputs.

Reduced: three windows of 256 tokens and 20 of the prompts, spread over their files, 6 greedy tokens each, and float32
activations rather than bf16 (bf16 matmuls are about ten times slower on a CPU without bf16 instructions); FP8 is
the same quantize -> dequantize either way. The full run's figures: README, "FP8 quality".
"""
from __future__ import annotations

import pytest

from bench import quality

# the limits: FP8 weights within +1.5% of the baseline's perplexity, with an FP8 KV cache within +3%
WEIGHTS_LIMIT, WEIGHTS_KV_LIMIT = 0.015, 0.03
# not met yet: per-output-channel e4m3 costs this 135M model +2.85% (+3.77% with the FP8 cache) over the whole text
# in bf16; strict, so the day the limits hold this fails until the mark goes
NOT_MET = pytest.mark.xfail(strict=True, reason="FP8 perplexity limits not met yet (README, FP8 quality)")
# this reduced run measures +3.56% and +6.95% (float32), and +6.69% with the activations rounded per token to e4m3
# as the FP8 x FP8 GEMMs do; a broken scale or cache costs far more
GUARD_WEIGHTS, GUARD_WEIGHTS_KV, GUARD_WEIGHTS_ACTIVATIONS = 0.06, 0.10, 0.10
# the full run (200 prompts, 32 tokens, bf16) kept 36% / 33% of the tokens before the first difference; these
# 6-token float32 outputs keep more (62% / 66%), while a broken FP8 path differs from its first token
PREFIX_FLOOR = 0.3


@pytest.fixture(scope="module")
def results():
    return quality.measure(dtype_name="float32", device="cpu", window=256, num_windows=3, num_prompts=20,
                           max_tokens=6, log=lambda line: None)


@NOT_MET
def test_fp8_weights_perplexity_within_limit(results):
    assert results["fp8_weights"]["perplexity_delta"] <= WEIGHTS_LIMIT, results["fp8_weights"]


@NOT_MET
def test_fp8_weights_and_kv_perplexity_within_limit(results):
    assert results["fp8_weights_kv"]["perplexity_delta"] <= WEIGHTS_KV_LIMIT, results["fp8_weights_kv"]


def test_fp8_perplexity_no_worse_than_measured(results):
    assert 0 < results["fp8_weights"]["perplexity_delta"] <= GUARD_WEIGHTS, results["fp8_weights"]
    assert results["fp8_weights_kv"]["perplexity_delta"] <= GUARD_WEIGHTS_KV, results["fp8_weights_kv"]
    activations = results["fp8_weights_activations"]
    # rounding the activations too adds error on top of the weights' (in this run: +3.1 points)
    assert results["fp8_weights"]["perplexity_delta"] < activations["perplexity_delta"] <= GUARD_WEIGHTS_ACTIVATIONS, \
        activations


def test_greedy_agreement_floor(results):
    assert results["baseline"]["greedy_exact"] == 1.0  # the reference itself
    for name in ("fp8_weights", "fp8_weights_kv", "fp8_weights_activations"):
        assert results[name]["greedy_prefix"] >= PREFIX_FLOOR, (name, results[name])


def test_only_linears_with_fp8_weights_round_their_inputs_per_token():
    import torch

    from backend.ops import fp8, get_ops

    ops = get_ops("torch")
    wrapped = quality.with_fp8_activations(ops)
    gen = torch.Generator().manual_seed(5)
    x, w = torch.randn(4, 32, generator=gen), torch.randn(8, 32, generator=gen)
    assert torch.equal(wrapped.linear(x, w), ops.linear(x, w))  # a wide weight (the LM head): its input untouched
    q, scale = fp8.quantize_per_channel(w)
    rounded = quality.round_rows_to_fp8(x)
    assert torch.equal(rounded[1], quality.round_rows_to_fp8(x[1:2])[0])  # each token under its own scale
    assert torch.equal(wrapped.linear(x, q, scale=scale), ops.linear(rounded, q, scale=scale))
    assert not torch.equal(rounded, x)
