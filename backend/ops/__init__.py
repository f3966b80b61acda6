"""Op sets for the model: the plain-torch path (reference, CPU and CUDA) and the Triton-language CUDA path."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

from backend.ops import layers as _torch_layers
from backend.ops.attention import AttentionMetadata, paged_attention as _torch_paged_attention

logger = logging.getLogger(__name__)

BACKENDS = ("torch", "triton")


@dataclass(frozen=True, slots=True)
class Ops:
    """The functions a model calls; every backend provides the same signatures."""

    name: str
    paged_attention: Callable
    rms_norm: Callable
    add_rms_norm: Callable
    apply_rope: Callable
    silu_and_mul: Callable


def _from_modules(name: str, attention: Callable, layers) -> Ops:
    return Ops(
        name=name,
        paged_attention=attention,
        rms_norm=layers.rms_norm,
        add_rms_norm=layers.add_rms_norm,
        apply_rope=layers.apply_rope,
        silu_and_mul=layers.silu_and_mul,
    )


def get_ops(backend: str) -> Ops:
    """Ops for "torch" or "triton"; Triton falls back to torch (with a warning) when it cannot be imported."""
    if backend not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "triton":
        try:
            # imported lazily: triton is absent on CPU-only machines
            from backend.ops import triton_layers
            from backend.ops.triton_attention import paged_attention as triton_paged_attention

            return _from_modules("triton", triton_paged_attention, triton_layers)
        except Exception as exc:  # ImportError, or a triton install that fails to initialise
            logger.warning("triton ops unavailable (%s: %s); using the torch ops", type(exc).__name__, exc)
    return _from_modules("torch", _torch_paged_attention, _torch_layers)


__all__ = ["AttentionMetadata", "Ops", "get_ops", "BACKENDS"]
