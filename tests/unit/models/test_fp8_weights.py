"""FP8 (e4m3) weight numbers against a numpy reference, fusing quantized parts, and random checkpoints in FP8."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from backend.models import fp8_weights, load_model
from backend.models.fp8_weights import FP8Weight, fuse, quantize_on_device
from backend.models.random_model import SHAPES, random_checkpoint
from backend.ops import fp8

E4M3_MAX = 448.0


def e4m3_round(x: np.ndarray) -> np.ndarray:
    """float32 values -> the nearest e4m3fn values (float64): 3 mantissa bits rounded to nearest, ties to even;
    below 2**-6 the subnormals' fixed spacing of 2**-9; saturated at ±448 (no infinities in e4m3fn)."""
    a = np.abs(x.astype(np.float64))
    _, e = np.frexp(a)  # a = m * 2**e with m in [0.5, 1)
    binade = np.maximum(e - 1, -6)  # a in [2**binade, 2**(binade + 1)); subnormals keep binade -6's spacing
    step = np.ldexp(1.0, binade - 3)
    rounded = np.round(a / step) * step  # a / step is exact; np.round rounds halves to even (the mantissa's LSB)
    return np.copysign(np.minimum(rounded, E4M3_MAX), x)


def e4m3_bits(values: np.ndarray) -> np.ndarray:
    """Exact e4m3fn values -> their bit patterns (uint8): sign, 4 exponent bits (bias 7), 3 mantissa bits."""
    a = np.abs(values)
    _, e = np.frexp(a)
    normal = a >= 2.0 ** -6
    exponent = np.where(normal, e - 1 + 7, 0)
    mantissa = np.where(normal, a / np.ldexp(1.0, e - 1) * 8 - 8, a / 2.0 ** -9)
    assert np.all(mantissa == np.round(mantissa)) and np.all((mantissa >= 0) & (mantissa < 8))
    bits = (exponent.astype(np.int64) << 3) | mantissa.astype(np.int64) | (np.signbit(values).astype(np.int64) << 7)
    return bits.astype(np.uint8)


def np_quantize_per_channel(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """W (N, K) float32 -> (e4m3 bits (N, K), scale (N,) float32), each row's largest magnitude to 448."""
    scale = np.maximum(np.abs(w).max(axis=1) / np.float32(E4M3_MAX), np.float32(1e-12)).astype(np.float32)
    scaled = np.clip(w / scale[:, None], -E4M3_MAX, E4M3_MAX).astype(np.float32)
    return e4m3_bits(e4m3_round(scaled)), scale


def np_quantize_per_block(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """W (N, K) float32 -> (e4m3 bits (N, K), scale (ceil(N/128), ceil(K/128)) float32), one scale per block."""
    n, k = w.shape
    bn, bk = -(-n // 128), -(-k // 128)
    padded = np.zeros((bn * 128, bk * 128), np.float32)
    padded[:n, :k] = w
    blocks = padded.reshape(bn, 128, bk, 128)
    scale = np.maximum(np.abs(blocks).max(axis=(1, 3)) / np.float32(E4M3_MAX), np.float32(1e-12)).astype(np.float32)
    scaled = np.clip(blocks / scale[:, None, :, None], -E4M3_MAX, E4M3_MAX).astype(np.float32)
    return e4m3_bits(e4m3_round(scaled.reshape(padded.shape)[:n, :k])), scale


def bits(q: torch.Tensor) -> np.ndarray:
    return q.view(torch.uint8).numpy()


def ties_and_subnormals() -> np.ndarray:
    """Values on e4m3 rounding boundaries (ties both ways, the subnormal range, the normal boundary) and 448."""
    return np.array([
        E4M3_MAX,  # a row holding exactly 448 has scale 1.0, so these values reach the cast unchanged
        1.0625, 1.1875, 1.125, -1.0625, 2.0 ** -10, 3 * 2.0 ** -10, 5 * 2.0 ** -10, 2.0 ** -11, 2.0 ** -9,
        2.0 ** -6 - 2.0 ** -10, 2.0 ** -6 + 2.0 ** -10, 15.5, 15.75, 240.0, 248.0, 432.0, 440.0, -440.0, 0.0,
    ], np.float32)


def weight_rows(k: int, seed: int = 0) -> np.ndarray:
    """(6, k) float32: an all-zero row, values far past 448, tiny values, a wide dynamic range (subnormals once
    scaled), boundary values at scale 1.0, and ordinary weights."""
    rng = np.random.default_rng(seed)
    rows = np.zeros((6, k), np.float32)
    rows[1] = rng.uniform(-3000.0, 3000.0, k)
    rows[1, 0] = 2999.5
    rows[2] = rng.normal(0.0, 1e-6, k)
    rows[3] = np.sign(rng.normal(size=k)) * 10.0 ** rng.uniform(-5, 3, k)
    ties = ties_and_subnormals()
    rows[4] = rng.normal(0.0, 0.5, k)
    rows[4, :len(ties)] = ties
    rows[5] = rng.normal(0.0, 0.02, k)
    return rows


def test_numpy_e4m3_rounding_equals_torch_cast():
    """The reference itself: every finite e4m3 value, ties, subnormals and random magnitudes, bit for bit."""
    every = np.array([v for v in (torch.arange(256, dtype=torch.uint8).view(fp8.FP8_DTYPE).float().numpy())
                      if np.isfinite(v)], np.float32)
    rng = np.random.default_rng(1)
    spread = (np.sign(rng.normal(size=4000)) * 2.0 ** rng.uniform(-14, np.log2(E4M3_MAX), 4000)).astype(np.float32)
    values = np.concatenate([every, ties_and_subnormals(), -ties_and_subnormals(), spread])
    want = e4m3_bits(e4m3_round(values))
    assert np.array_equal(bits(torch.from_numpy(values).to(fp8.FP8_DTYPE)), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_per_channel_equals_numpy(dtype):
    w = torch.from_numpy(np.concatenate([weight_rows(300), weight_rows(300, seed=5)])).to(dtype)  # (12, 300)
    q, scale = fp8.quantize_per_channel(w)
    want_bits, want_scale = np_quantize_per_channel(w.float().numpy())
    assert q.dtype == fp8.FP8_DTYPE and scale.dtype == torch.float32
    assert np.array_equal(scale.numpy(), want_scale)
    assert np.array_equal(bits(q), want_bits)
    assert scale[0].item() == np.float32(1e-12) and not bits(q)[0].any()  # the all-zero row: scale kept, zeros
    assert np.abs(e4m3_round(w.float().numpy()[1] / want_scale[1])).max() == E4M3_MAX


def test_quantize_per_block_equals_numpy():
    """Partial blocks at both edges (200 x 300), a block of zeros, blocks past 448."""
    rng = np.random.default_rng(2)
    w = rng.normal(0.0, 0.05, (200, 300)).astype(np.float32)
    w[:6] = weight_rows(300)
    w[128:, 128:256] = 0.0  # one whole block of zeros
    w[130:140, :40] *= 50000.0  # past 448 in block (1, 0)
    q, scale = fp8.quantize_per_block(torch.from_numpy(w))
    want_bits, want_scale = np_quantize_per_block(w)
    assert scale.shape == (2, 3)
    assert np.array_equal(scale.numpy(), want_scale)
    assert np.array_equal(bits(q), want_bits)
    assert scale[1, 1].item() == np.float32(1e-12)


@pytest.mark.parametrize("layout", ["channel", "block"])
def test_dequantize_equals_numpy(layout):
    """q * s in float32 (each product rounded once), then to the model's dtype."""
    w = torch.from_numpy(np.random.default_rng(3).normal(0.0, 0.05, (260, 140)).astype(np.float32))
    q, scale = fp8.quantize_per_channel(w) if layout == "channel" else fp8.quantize_per_block(w)
    values = q.float().numpy()  # e4m3 -> float32 is exact
    s = scale.numpy()
    expanded = s[:, None] if layout == "channel" else np.repeat(np.repeat(s, 128, 0)[:260], 128, 1)[:, :140]
    want = (values * expanded).astype(np.float32)
    assert np.array_equal(fp8.dequantize(q, scale, torch.float32).numpy(), want)
    assert torch.equal(fp8.dequantize(q, scale, torch.bfloat16), torch.from_numpy(want).to(torch.bfloat16))


def test_quantize_on_device_in_row_chunks_equals_one_pass(monkeypatch):
    monkeypatch.setattr(fp8_weights, "_QUANTIZE_ROWS", 5)
    w = torch.from_numpy(np.concatenate([weight_rows(64), weight_rows(64, 1)]))  # (12, 64): chunks of 5, 5, 2
    got = quantize_on_device(w.to(torch.bfloat16), torch.device("cpu"))
    q, scale = fp8.quantize_per_channel(w.to(torch.bfloat16))
    assert torch.equal(got.scale, scale) and np.array_equal(bits(got.weight), bits(q))


def _parts(rows: list[int], k: int, block: bool) -> list[FP8Weight]:
    g = torch.Generator().manual_seed(sum(rows))
    out = []
    for i, n in enumerate(rows):
        w = torch.randn(n, k, generator=g) * (0.01 * (i + 1))  # each part its own range, so its own scales
        out.append(FP8Weight(*(fp8.quantize_per_block(w) if block else fp8.quantize_per_channel(w))))
    return out


def _dequantized(parts: list[FP8Weight]) -> torch.Tensor:
    return torch.cat([fp8.dequantize(p.weight, p.scale, torch.float32) for p in parts])


def test_fuse_per_channel_parts_concatenates_exactly():
    parts = _parts([64, 32, 32], 48, block=False)
    fused, requantized = fuse(parts, ["q", "k", "v"])
    assert not requantized and fused.scale.shape == (128,)
    assert torch.equal(fp8.dequantize(fused.weight, fused.scale, torch.float32), _dequantized(parts))


def test_fuse_block_parts_of_whole_blocks_concatenates_block_rows_exactly():
    """q, k, v of 256, 128, 128 rows (every part but the last whole blocks; K 200: a partial block column)."""
    parts = _parts([256, 128, 100], 200, block=True)
    fused, requantized = fuse(parts, ["q", "k", "v"])
    assert not requantized and fused.scale.shape == (4, 2)
    assert torch.equal(fp8.dequantize(fused.weight, fused.scale, torch.float32), _dequantized(parts))


@pytest.mark.parametrize("mixed", [False, True], ids=["unaligned-blocks", "channel-and-block"])
def test_fuse_that_would_straddle_blocks_requantizes_within_one_rounding(mixed):
    """A tiny model's k and v (32 rows each): a fused block would hold two parts' scales, so the fused weight is
    requantized per block from the exact float32 values: within half an e4m3 step of each value."""
    parts = _parts([64, 32, 32], 64, block=True)
    if mixed:
        parts[1] = _parts([32], 64, block=False)[0]
    fused, requantized = fuse(parts, ["q", "k", "v"])
    assert requantized and fused.scale.shape == (1, 1)
    exact = _dequantized(parts)
    got = fp8.dequantize(fused.weight, fused.scale, torch.float32)
    half_step = torch.maximum(exact.abs() * 2.0 ** -4, fused.scale * 2.0 ** -10)  # normals; subnormals' spacing
    assert torch.all((got - exact).abs() <= half_step * (1 + 1e-6))
    assert not torch.equal(got, exact)  # it is a second rounding, not the checkpoint's values


def test_fuse_rejects_parts_of_different_widths():
    with pytest.raises(ValueError, match="different input sizes"):
        fuse(_parts([32], 48, False) + _parts([32], 64, False), ["gate", "up"])


@pytest.fixture(scope="module")
def random_tiny(tmp_path_factory):
    return random_checkpoint("tiny", tmp_path_factory.mktemp("random"))


def test_random_checkpoint_fp8_is_the_same_draws_quantized(random_tiny):
    """quantization=fp8 draws each matrix as the wide model does, then quantizes it per channel; embeddings, LM head
    and norms are the wide model's own; the KV scales of an FP8 cache are 1.0."""
    wide = load_model(random_tiny)
    q8 = load_model(random_tiny, quantization="fp8", kv_cache_dtype="fp8")
    for a, b in zip(wide.layers, q8.layers):
        for name in ("qkv", "o", "gate_up", "down"):
            w, scale = getattr(b, f"{name}_weight"), getattr(b, f"{name}_scale")
            q, want_scale = fp8.quantize_per_channel(getattr(a, f"{name}_weight"))
            assert w.dtype == fp8.FP8_DTYPE and torch.equal(scale, want_scale)
            assert np.array_equal(bits(w), bits(q))
        assert torch.equal(a.input_norm, b.input_norm) and a.kv_scale is None
        assert torch.equal(b.kv_scale, torch.tensor([1.0, 1.0]))
    assert q8.embed_tokens.dtype == torch.float32 and torch.equal(wide.embed_tokens, q8.embed_tokens)
    assert torch.equal(wide.lm_head, q8.lm_head)


def test_random_llama_3_70b_shape(tmp_path):
    """The 70B shape's config (its weights are only drawn on a GPU: about 70 GB in FP8)."""
    assert SHAPES["llama-3-70b"]["max_position_embeddings"] == SHAPES["llama-3-8b"]["max_position_embeddings"]
    config = json.loads((Path(random_checkpoint("llama-3-70b", tmp_path)) / "config.json").read_text())
    assert (config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]) == (8192, 28672, 80)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (64, 8)
    assert (config["vocab_size"], config["rope_parameters"]["rope_theta"]) == (128256, 500000.0)
    n_linear = 80 * (8192 * (64 + 16) * 128 + 8192 * 8192 + 3 * 8192 * 28672)
    assert 68e9 < n_linear + 2 * 2 * 128256 * 8192 < 73e9  # FP8 linears + bf16 embeddings and LM head, bytes


class _TorchWithMetaDraws:
    """torch for random_model, whose generator is a CPU one on the meta device (torch has none there; a meta
    tensor's normal_ draws nothing): random weights drawn on meta have their shapes and dtypes, and no storage."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def Generator(device=None):  # torch's own name: random_model calls torch.Generator(device=...)
        return torch.Generator("cpu" if torch.device(device).type == "meta" else device)


@pytest.mark.parametrize("quantization", ["none", "fp8"])
def test_random_llama_3_70b_has_its_parameters_and_bytes(tmp_path, monkeypatch, quantization):
    """The 70B shape built on the meta device (nothing allocated): 70,553,706,496 parameters, 68.45e9 of them in
    linear weights; bf16 takes 2 bytes each, quantization=fp8 1 byte a linear weight plus a float32 scale per output
    channel, the embeddings, LM head and norms staying bf16 (72.68e9 bytes, about half)."""
    from backend.models import random_model

    monkeypatch.setattr(random_model, "torch", _TorchWithMetaDraws())
    model = load_model(random_checkpoint("llama-3-70b", tmp_path), dtype=torch.bfloat16, device="meta",
                       quantization=quantization)
    hidden, inter, layers, heads, kv_heads, vocab, head_dim = 8192, 28672, 80, 64, 8, 128256, 8192 // 64
    rows = {"qkv": (heads + 2 * kv_heads) * head_dim, "o": hidden, "gate_up": 2 * inter, "down": hidden}
    cols = {"qkv": hidden, "o": heads * head_dim, "gate_up": hidden, "down": inter}
    n_linear = layers * sum(rows[name] * cols[name] for name in rows)
    n_other = 2 * vocab * hidden + (2 * layers + 1) * hidden  # embeddings, LM head (untied), norms
    assert (n_linear, n_linear + n_other) == (68_451_041_280, 70_553_706_496)
    params = dict(model.named_parameters())
    assert all(p.device.type == "meta" for p in params.values())
    linear = {n: p for n, p in params.items() if n.rsplit(".", 1)[-1] in {f"{name}_weight" for name in rows}}
    scales = {n: p for n, p in params.items() if n.endswith("_scale")}
    other = {n: p for n, p in params.items() if n not in linear and n not in scales}
    assert len(linear) == 4 * layers and sum(p.numel() for p in linear.values()) == n_linear
    assert sum(p.numel() for p in other.values()) == n_other
    assert {p.dtype for p in other.values()} == {torch.bfloat16}

    def nbytes(tensors):
        return sum(p.numel() * p.element_size() for p in tensors.values())

    if quantization == "none":
        assert not scales and {p.dtype for p in linear.values()} == {torch.bfloat16}
        assert nbytes(params) == 2 * (n_linear + n_other) == 141_107_412_992
        return
    assert {p.dtype for p in linear.values()} == {fp8.FP8_DTYPE}
    assert {p.dtype for p in scales.values()} == {torch.float32}
    assert {n: tuple(p.shape) for n, p in scales.items()} == {
        f"layers.{i}.{name}_scale": (rows[name],) for i in range(layers) for name in rows}
    want = n_linear + 4 * layers * sum(rows.values()) + 2 * n_other
    assert nbytes(params) == want == 72_683_241_472
