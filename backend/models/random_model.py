"""Random-weight checkpoints of real model shapes ("random:llama-3-8b"), for benchmarks and tests.

The folder holds a real config.json and a byte-level tokenizer built in code; the weights are drawn on the
device at load time (a marker file says so), so an 8B-shaped model costs no disk and no download.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from backend.models.fp8_weights import quantize_on_device
from backend.models.llama import LayerWeights
from backend.models.spec import ModelSpec

RANDOM_PREFIX = "random:"
MARKER = "random_weights.json"
EOS_ID = 256  # the byte tokenizer's one special token

SHAPES = {
    # Llama-3-8B: the seed article's model
    "llama-3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192 + 1024,
                       rope_theta=500000.0),
    # Llama-3.1-8B: the same weights' shape with its long context (rope scaling), for generations past 8K (blog-16k)
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
                         rope_theta=500000.0,
                         rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                           high_freq_factor=4.0, original_max_position_embeddings=8192)),
    # Llama-3-70B: with quantization=fp8 drawn straight into FP8 (72.7 GB of weights), so it fits one H200
    "llama-3-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192 + 1024,
                        rope_theta=500000.0),
    # Llama-3.2-1B: the CPU-bound regime (small-64)
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
                         rope_theta=500000.0, tie_word_embeddings=True,
                         rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                                           high_freq_factor=4.0, original_max_position_embeddings=8192)),
    # CI-sized
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, max_position_embeddings=4096),
}


def random_checkpoint(name: str, root: Path) -> str:
    """Write (once) the folder for shape `name` under root; returns its path."""
    if name not in SHAPES:
        raise ValueError(f"unknown random model shape {name!r}; known: {', '.join(SHAPES)}")
    folder = root / f"random-{name}"
    if (folder / MARKER).is_file():
        return str(folder)
    from transformers import LlamaConfig

    tmp = root / f".random-{name}-{os.getpid()}"
    tmp.mkdir(parents=True, exist_ok=True)
    LlamaConfig(**SHAPES[name], bos_token_id=EOS_ID, eos_token_id=EOS_ID).save_pretrained(tmp)
    byte_tokenizer().save_pretrained(tmp)
    (tmp / MARKER).write_text(json.dumps({"seed": 0, "std": 0.02}))
    try:
        tmp.rename(folder)
    except OSError:  # another process won the race: its folder is the same
        pass
    return str(folder)


def byte_tokenizer():
    """A byte-level tokenizer (256 byte tokens + one EOS) built with the tokenizers library."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet, key=lambda c: _byte_of(c)))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|end_of_text|>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end_of_text|>")


def _byte_of(ch: str) -> int:
    """Order the ByteLevel alphabet by the byte each character stands for, so id == byte value."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(map(chr, cs), bs))[ch]


def is_random_checkpoint(folder: Path) -> bool:
    return (folder / MARKER).is_file()


def random_weights(folder: Path, config, spec: ModelSpec, dtype: torch.dtype, device: torch.device,
                   quantize: bool = False) -> dict:
    """Weights drawn on the device, N(0, std) for matrices and ones for norms, in the fused layout.

    quantize: each linear weight is drawn in dtype, quantized per output channel and freed before the next is
    drawn, so only one layer's weight is ever wide (a 70B shape fits in FP8); the same draws as without it."""
    meta = json.loads((folder / MARKER).read_text())
    gen = torch.Generator(device=device).manual_seed(int(meta.get("seed", 0)))
    std = float(meta.get("std", 0.02))
    H, I, D = spec.hidden_size, spec.intermediate_size, spec.head_dim
    qkv_rows = (spec.num_heads + 2 * spec.num_kv_heads) * D

    def rand(*shape):
        return torch.empty(shape, dtype=dtype, device=device).normal_(0.0, std, generator=gen)

    def linear(*shape) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not quantize:
            return rand(*shape), None
        q = quantize_on_device(rand(*shape), device)
        return q.weight, q.scale

    def ones(n):
        return torch.ones(n, dtype=dtype, device=device)

    layers = []
    for _ in range(spec.num_layers):
        qkv, qkv_scale = linear(qkv_rows, H)
        o, o_scale = linear(H, spec.num_heads * D)
        gate_up, gate_up_scale = linear(2 * I, H)
        down, down_scale = linear(H, I)
        layers.append(LayerWeights(qkv_weight=qkv, qkv_bias=None, o_weight=o, o_bias=None, gate_up_weight=gate_up,
                                   gate_up_bias=None, down_weight=down, down_bias=None, input_norm=ones(H),
                                   post_norm=ones(H), q_norm=None, k_norm=None, qkv_scale=qkv_scale, o_scale=o_scale,
                                   gate_up_scale=gate_up_scale, down_scale=down_scale))
    tied = bool(getattr(config, "tie_word_embeddings", False))
    # embeddings and LM head stay in dtype (backend/models/loader.py says why)
    return dict(embed=rand(spec.vocab_size, H), layers=layers, final_norm=ones(H),
                lm_head=None if tied else rand(spec.vocab_size, H))
