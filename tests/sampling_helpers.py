"""Sampling settings built the simple way for tests: fresh tensors for one batch, and preallocated buffers refilled
per batch (the engine itself packs them into a pipeline slot's buffers: backend/executor/packer.py)."""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from backend.executor.sampler import _NUM_FLOAT_FIELDS, SamplingTensors, _most_logprobs, _param_columns, \
    _seeds_array, host_to_device, fill_padding_rows, pad_token_table, row_flags, tensors_from_rows
from backend.request import SamplingParams


def fill_host_rows(params, seeds, step_indices, host_f, host_i, host_k) -> dict:
    """Write per-row settings into host arrays (6, n) f32, (2, n) i64, (n,) i32; return the host flags."""
    n = len(params)
    if len(seeds) != n or len(step_indices) != n:
        raise ValueError(f"need one seed and one step index per row: {n} rows, {len(seeds)} seeds, "
                         f"{len(step_indices)} step indices")
    if n == 0:
        raise ValueError("a sampling batch needs at least one row")
    host_f[:], host_k[:] = _param_columns(params)
    host_i[0] = _seeds_array(seeds)
    host_i[1] = np.asarray(step_indices, dtype=np.int64)
    return row_flags(host_f, host_k, _most_logprobs(params))


def _penalty_tokens(any_penalty, prompt_token_ids, output_token_ids, size, device):
    """(size, L) int64 token tables padded with -1, or (None, None) when no row has a penalty."""
    if not any_penalty:
        return None, None
    if prompt_token_ids is None or output_token_ids is None:
        raise ValueError("penalties need prompt_token_ids and output_token_ids for every row")
    return pad_token_table(prompt_token_ids, size, device), pad_token_table(output_token_ids, size, device)


def assemble_tensors(dev_f, dev_i, dev_k, prompt, output, flags) -> SamplingTensors:
    """SamplingTensors over device arrays (6, B) f32, (2, B) i64 and (B,) i32 (fill_host_rows' layout)."""
    return tensors_from_rows((*dev_f.unbind(0), *dev_i.unbind(0), dev_k), prompt, output, flags)


def sampling_tensors_from_params(
    params: Sequence[SamplingParams],
    seeds: Sequence[int],
    step_indices: Sequence[int] | np.ndarray,
    device: torch.device | str,
    prompt_token_ids: Sequence[Sequence[int]] | None = None,
    output_token_ids: Sequence[Sequence[int]] | None = None,
) -> SamplingTensors:
    """Build fresh tensors for one batch (host arrays copied without blocking on CUDA)."""
    device = torch.device(device)
    n = len(params)
    host_f = np.empty((_NUM_FLOAT_FIELDS, n), dtype=np.float32)
    host_i = np.empty((2, n), dtype=np.int64)
    host_k = np.empty((n,), dtype=np.int32)
    flags = fill_host_rows(params, seeds, step_indices, host_f, host_i, host_k)
    dev_f, dev_i, dev_k = (host_to_device(a, device) for a in (host_f, host_i, host_k))
    prompt, output = _penalty_tokens(flags["any_penalty"], prompt_token_ids, output_token_ids, n, device)
    return assemble_tensors(dev_f, dev_i, dev_k, prompt, output, flags)


class SamplingBuffers:
    """Preallocated pinned host and device tensors for a fixed max batch, so a captured sampler sees static addresses.

    Use one per pipeline slot: `fill` rewrites the host buffers, so the previous step that used this object
    must have finished its host-to-device copy (the slot's event guarantees it).
    """

    def __init__(self, max_batch_size: int, device: torch.device | str):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.device = torch.device(device)
        self.max_batch_size = max_batch_size
        pin = self.device.type == "cuda"
        self._host_f = torch.empty((_NUM_FLOAT_FIELDS, max_batch_size), dtype=torch.float32, pin_memory=pin)
        self._host_i = torch.empty((2, max_batch_size), dtype=torch.int64, pin_memory=pin)
        self._host_k = torch.empty((max_batch_size,), dtype=torch.int32, pin_memory=pin)
        self._dev_f = torch.empty_like(self._host_f, device=self.device)  # (6, max_B)
        self._dev_i = torch.empty_like(self._host_i, device=self.device)  # (2, max_B)
        self._dev_k = torch.empty_like(self._host_k, device=self.device)  # (max_B,)

    def fill(
        self,
        params: Sequence[SamplingParams],
        seeds: Sequence[int],
        step_indices: Sequence[int] | np.ndarray,
        batch_size: int | None = None,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        output_token_ids: Sequence[Sequence[int]] | None = None,
    ) -> SamplingTensors:
        """Write a batch into rows [0, len(params)), pad rows up to batch_size as greedy; return views.

        The copy is queued on the current stream. Penalty token lists vary in width, so they are fresh
        tensors: a step with penalties should run the sampler eagerly, not from a captured graph.
        """
        n = len(params)
        size = n if batch_size is None else batch_size
        if not 1 <= size <= self.max_batch_size or size < n:
            raise ValueError(f"batch_size must be in [{max(n, 1)}, {self.max_batch_size}], got {size}")
        host_f, host_i, host_k = self._host_f.numpy(), self._host_i.numpy(), self._host_k.numpy()
        flags = fill_host_rows(params, seeds, step_indices, host_f[:, :n], host_i[:, :n], host_k[:n])
        fill_padding_rows(host_f[:, n:size], host_i[:, n:size], host_k[n:size])
        non_blocking = self.device.type == "cuda"
        self._dev_f[:, :size].copy_(self._host_f[:, :size], non_blocking=non_blocking)
        self._dev_i[:, :size].copy_(self._host_i[:, :size], non_blocking=non_blocking)
        self._dev_k[:size].copy_(self._host_k[:size], non_blocking=non_blocking)
        prompt, output = _penalty_tokens(flags["any_penalty"], prompt_token_ids, output_token_ids, size, self.device)
        return assemble_tensors(self._dev_f[:, :size], self._dev_i[:, :size], self._dev_k[:size], prompt, output, flags)
