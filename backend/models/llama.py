"""Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5, Qwen3, SmolLM2) with fused qkv and gate/up weights."""
from __future__ import annotations

import importlib
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

from backend.models.spec import ModelSpec
from backend.ops import Ops
from backend.ops.attention_metadata import AttentionMetadata

# model_type -> the transformers class prefix whose RotaryEmbedding we reuse
ROTARY_CLASSES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}
# these rope types change their frequencies with the batch's sequence length, which a static cache can't follow
_DYNAMIC_ROPE_TYPES = ("dynamic", "longrope")


@dataclass(slots=True)
class LayerWeights:
    """One decoder layer's tensors, already fused, cast and on the target device."""

    qkv_weight: torch.Tensor  # ((Hq + 2 Hkv) D, H)
    qkv_bias: torch.Tensor | None  # ((Hq + 2 Hkv) D,): Qwen2 and attention_bias models
    o_weight: torch.Tensor  # (H, Hq D)
    o_bias: torch.Tensor | None
    gate_up_weight: torch.Tensor  # (2 I, H): gate rows first
    gate_up_bias: torch.Tensor | None
    down_weight: torch.Tensor  # (H, I)
    down_bias: torch.Tensor | None
    input_norm: torch.Tensor  # (H,)
    post_norm: torch.Tensor  # (H,)
    q_norm: torch.Tensor | None  # (D,): Qwen3 per-head RMSNorm before rope
    k_norm: torch.Tensor | None  # (D,)
    # FP8 (e4m3) weights carry float32 scales (backend/ops/fp8.py): (N,) per output channel, or
    # (ceil(N/128), ceil(K/128)) per 128 x 128 block; None for weights in the model's dtype
    qkv_scale: torch.Tensor | None = None
    o_scale: torch.Tensor | None = None
    gate_up_scale: torch.Tensor | None = None
    down_scale: torch.Tensor | None = None
    # (2,) float32 [k_scale, v_scale] of an FP8 KV cache (a cached value times its scale is the real value); None
    # when the cache holds the model's dtype
    kv_scale: torch.Tensor | None = None


def _param(t: torch.Tensor | None) -> nn.Parameter | None:
    return None if t is None else nn.Parameter(t, requires_grad=False)


class DecoderLayer(nn.Module):
    """Pre-norm attention + gated MLP block, reading fused weights."""

    def __init__(self, w: LayerWeights):
        super().__init__()
        for f in fields(LayerWeights):
            setattr(self, f.name, _param(getattr(w, f.name)))

    def forward(self, h, residual, positions, kv_layer, meta, model: "LlamaFamilyModel", ops: Ops):
        """h, residual (T, H) -> (h, residual) after this layer, launched with ops; residual None on the first layer.

        The h returned may be split-K partial sums (PartialSums): only add_rms_norm reads it."""
        spec, eps = model.spec, model.eps
        if residual is None:
            residual, x = h, ops.rms_norm(h, self.input_norm, eps)
        else:
            x, residual = ops.add_rms_norm(h, residual, self.input_norm, eps)
        # without the q/k norms only rope_attention reads qkv, and it can add split-K partials itself
        linear = ops.linear if self.q_norm is not None else ops.linear_parked
        qkv = linear(x, self.qkv_weight, self.qkv_bias, scale=self.qkv_scale)  # (T, (Hq + 2 Hkv) D), or its partial sums
        q, k, v = qkv.split(model.qkv_sizes, dim=-1)
        t = x.shape[0]
        q = q.view(t, spec.num_heads, spec.head_dim)  # (T, Hq, D)
        k = k.view(t, spec.num_kv_heads, spec.head_dim)  # (T, Hkv, D)
        v = v.view(t, spec.num_kv_heads, spec.head_dim)  # (T, Hkv, D)
        if self.q_norm is not None:
            q, k = ops.rms_norm(q, self.q_norm, eps), ops.rms_norm(k, self.k_norm, eps)
        # rotary embedding, this step's K/V into the cache, then attention over the cache: (T, Hq, D)
        attn = ops.rope_attention(q, k, v, positions, model.cos_sin_cache, kv_layer, meta, model.scale,
                                  kv_scale=self.kv_scale)
        h = ops.linear_parked(attn.reshape(t, -1), self.o_weight, self.o_bias, scale=self.o_scale)  # (T, H) or its partial sums
        x, residual = ops.add_rms_norm(h, residual, self.post_norm, eps)
        act = ops.linear_silu_and_mul(x, self.gate_up_weight, self.gate_up_bias, scale=self.gate_up_scale)  # (T, I)
        h = ops.linear_parked(act, self.down_weight, self.down_bias, scale=self.down_scale)  # (T, H) or its partial sums
        return h, residual


class LlamaFamilyModel(nn.Module):
    """The whole decoder: embeddings, layers over one paged KV tensor, final norm and LM head."""

    def __init__(
        self,
        spec: ModelSpec,
        ops: Ops,
        embed: torch.Tensor,
        layers: list[LayerWeights],
        final_norm: torch.Tensor,
        lm_head: torch.Tensor | None,
        cos_sin_cache: torch.Tensor,
        eps: float,
    ):
        super().__init__()
        self.spec, self.ops, self.eps = spec, ops, eps  # ops: what a forward launches with unless given others
        self.scale = spec.head_dim**-0.5
        self.qkv_sizes = [
            spec.num_heads * spec.head_dim,
            spec.num_kv_heads * spec.head_dim,
            spec.num_kv_heads * spec.head_dim,
        ]
        self.embed_tokens = _param(embed)  # (V, H)
        self.layers = nn.ModuleList(DecoderLayer(w) for w in layers)
        self.norm = _param(final_norm)  # (H,)
        # tied embeddings share one tensor, so the head costs no memory
        self.lm_head = self.embed_tokens if lm_head is None else _param(lm_head)  # (V, H)
        self.register_buffer("cos_sin_cache", cos_sin_cache, persistent=False)  # (max_pos, D) float32

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, ops: Ops | None = None) -> torch.Tensor:
        """input_ids, positions (T,) int64; kv_cache (L, 2, NB, BS, Hkv, D) -> hidden (T, H). ops: the op set the
        kernels launch with (e.g. without dependent launch), the model's own when None."""
        ops = ops or self.ops
        h = F.embedding(input_ids, self.embed_tokens)  # (T, H)
        residual = None
        for i, layer in enumerate(self.layers):
            h, residual = layer(h, residual, positions, kv_cache[i], meta, self, ops)
        h, _ = ops.add_rms_norm(h, residual, self.norm, self.eps)
        return h

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None,
                       ops: Ops | None = None) -> torch.Tensor:
        """hidden (N, H) -> logits (N, V) in the model's dtype, written into out (N, V) when given; ops as forward's.

        The sampler converts to float32 itself, so a greedy decode graph reads bf16 logits and never converts."""
        return (ops or self.ops).linear(hidden, self.lm_head, None, out)


def build_cos_sin_cache(config, model_type: str, head_dim: int, device: torch.device) -> torch.Tensor:
    """(max_pos, D) float32 cache: [:D/2] cos, [D/2:] sin, from transformers' own RotaryEmbedding of the family.

    Reusing transformers' class makes every static rope type (default, linear, llama3, yarn, ...) match it
    exactly, including the attention scaling it folds into cos/sin.
    """
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type in _DYNAMIC_ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} depends on the sequence length at run time and is unsupported")
    prefix = ROTARY_CLASSES[model_type]
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    rotary = getattr(module, f"{prefix}RotaryEmbedding")(config)
    inv_freq = rotary.inv_freq.float()  # (D/2,)
    if inv_freq.shape[0] * 2 != head_dim:
        rot = inv_freq.shape[0] * 2
        raise ValueError(f"partial rotary embeddings are unsupported (rotary dim {rot} != head_dim {head_dim})")
    positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]  # (max_pos, D/2), the same float32 product HF forms
    scaling = rotary.attention_scaling
    cache = torch.cat((freqs.cos() * scaling, freqs.sin() * scaling), dim=-1)  # (max_pos, D)
    return cache.to(device)
