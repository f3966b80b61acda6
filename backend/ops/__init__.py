"""Op sets for the model: the plain-torch path (reference, CPU and CUDA) and the Triton-language CUDA path."""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Callable, NamedTuple

from backend.ops.torch import layers as _torch_layers
from backend.ops.attention_metadata import AttentionMetadata
from backend.ops.torch.attention import paged_attention as _torch_paged_attention

logger = logging.getLogger(__name__)

BACKENDS = ("torch", "triton")
LINEAR_BACKENDS = ("auto", "cublas", "triton")


@dataclass(frozen=True, slots=True)
class Ops:
    """The functions a model calls; every backend provides the same signatures."""

    name: str
    rms_norm: Callable
    add_rms_norm: Callable
    # (q, k, v, positions, cos_sin_cache, kv_cache_layer, meta, scale, *, kv_scale=None): rotary embedding and this step's K/V into
    # the cache (rope_write_kv), then paged attention of the rotated q over the cache; one kernel for decode steps
    # where it can. kv_scale: (2,) float32 [k_scale, v_scale] of an FP8 cache (stored = value / scale), else None
    rope_attention: Callable
    # (x, weight, bias=None, out=None, *, scale=None): F.linear, optionally into a preallocated 2-D out. scale: the
    # float32 scales of an FP8 weight (backend/ops/fp8.py: per output channel or per 128 x 128 block), None for a
    # weight in x's dtype
    linear: Callable
    # (x, weight, bias=None, *, scale=None): a linear whose output only feeds add_rms_norm or rope_attention, which read it anyway;
    # it may return split-K partials (PartialSums) for that kernel to add up
    linear_parked: Callable
    # (x, gate_up_weight, bias=None, *, scale=None): silu_and_mul(linear(x, gate_up_weight, bias)), in one kernel where it can
    linear_silu_and_mul: Callable
    greedy_argmax: Callable  # (logits (N, V), out (N,) int64): each row's first maximum into out
    # (logits, temperature, top_k, top_p, min_p, seeds, step_index, out, *, logprobs, ranks, lse): the whole sampler
    # in one kernel (ops/triton/sampling.py); None: the torch sampler's code runs instead
    sample_rows: Callable | None = None


def _from_modules(name: str, layers, rope_attention: Callable, linear: Callable = _torch_layers.linear,
                  greedy_argmax: Callable = _torch_layers.greedy_argmax, linear_parked: Callable | None = None,
                  linear_silu_and_mul: Callable | None = None, sample_rows: Callable | None = None) -> Ops:
    def unfused_linear_silu_and_mul(x, gate_up_weight, bias=None, *, scale=None):
        return layers.silu_and_mul(linear(x, gate_up_weight, bias, scale=scale))

    return Ops(
        name=name,
        rms_norm=layers.rms_norm,
        add_rms_norm=layers.add_rms_norm,
        rope_attention=rope_attention,
        linear=linear,
        linear_parked=linear_parked or linear,
        linear_silu_and_mul=linear_silu_and_mul or unfused_linear_silu_and_mul,
        greedy_argmax=greedy_argmax,
        sample_rows=sample_rows,
    )


def _torch_rope_attention(q, k, v, positions, cos_sin_cache, kv_cache_layer, meta, scale, *, kv_scale=None):
    """The plain path's rope_attention: rope_write_kv, then paged_attention of the rotated q over the cache."""
    q = _torch_layers.rope_write_kv(q, k, v, positions, cos_sin_cache, kv_cache_layer, meta.slot_mapping,
                                    kv_scale=kv_scale)
    return _torch_paged_attention(q, None, None, kv_cache_layer, meta, scale, kv_scale=kv_scale)


def get_ops(backend: str, linear_backend: str = "auto", dependent_launch: bool = False) -> Ops:
    """Ops for "torch" or "triton"; Triton falls back to torch (with a warning) when it cannot be imported.

    linear_backend, on the triton path: "auto" takes the decode-sized GEMM kernel for the shapes where it was
    measured faster than cuBLAS (triton_linear.H200_CONFIGS), "triton" for every batch of up to 64 rows, "cublas"
    never. The torch path always uses F.linear. FP8 weights (a scale given): "auto" and "triton" run the FP8 decode
    kernel up to 64 rows (auto with tuning/h200_fp8.py's configs) and FP8 x FP8 GEMMs above; "cublas" quantizes x
    per row and runs torch._scaled_mm for every row count (ops/triton/fp8_linear.py); the torch path dequantizes.
    dependent_launch, on the triton path: launch every Triton-language kernel as a programmatic dependent of the
    kernel before it (ops/triton/launch.py; compute capability 9.0 and later only)."""
    if backend not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {backend!r}")
    if linear_backend not in LINEAR_BACKENDS:
        raise ValueError(f"linear backend must be one of {LINEAR_BACKENDS}, got {linear_backend!r}")
    if backend == "triton":
        try:
            return _triton_ops(linear_backend, dependent_launch)
        except Exception as exc:  # ImportError, or a triton install that fails to initialise
            logger.warning("triton ops unavailable (%s: %s); using the torch ops", type(exc).__name__, exc)
    return _from_modules("torch", _torch_layers, _torch_rope_attention)


def _triton_ops(linear_backend: str, pdl: bool) -> Ops:
    # imported lazily: triton is absent on CPU-only machines
    from backend.ops.triton import argmax as triton_argmax, layers as triton_layers, linear as triton_linear
    from backend.ops.triton import sampling as triton_sampling
    from backend.ops.triton.attention import rope_paged_attention

    def bind(fn: Callable) -> Callable:
        return functools.partial(fn, pdl=True) if pdl else fn

    layers = _BoundLayers(*(bind(getattr(triton_layers, f)) for f in _BoundLayers._fields))
    linear = {"auto": bind(triton_linear.tuned_linear), "triton": bind(triton_linear.linear),
              "cublas": triton_linear.cublas_linear}[linear_backend]
    parking = functools.partial(linear, park=True) if linear_backend == "auto" else linear
    gated = {"auto": bind(triton_linear.tuned_linear_silu_and_mul),
             "triton": bind(triton_linear.linear_silu_and_mul), "cublas": None}[linear_backend]
    name = "triton+pdl" if pdl else "triton"
    return _from_modules(name, layers, bind(rope_paged_attention), linear, bind(triton_argmax.greedy_argmax),
                         parking, gated, bind(triton_sampling.sample_rows))


class _BoundLayers(NamedTuple):
    """The element-wise layer kernels, each with its launch mode bound."""

    rms_norm: Callable
    add_rms_norm: Callable
    silu_and_mul: Callable


__all__ = ["AttentionMetadata", "Ops", "get_ops", "BACKENDS", "LINEAR_BACKENDS"]
