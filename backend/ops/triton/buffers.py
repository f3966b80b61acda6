"""Host-side helpers the Triton-language kernels share: output buffers and the device's SM count."""
from __future__ import annotations

import functools

import torch


def alloc(shape, dtype, device) -> torch.Tensor:
    """A fresh, uninitialised buffer; one indirection so tests can poison every new output."""
    return torch.empty(shape, dtype=dtype, device=device)


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 8 under Triton's CPU interpreter (any small number keeps the
    split logic exercised)."""
    if device.type != "cuda":
        return 8
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())
