"""What every attention op of a step reads besides q, k and v: the step's token slots and its sequences' contexts."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """Where each token of a step writes its K/V and which cached context each sequence reads."""

    slot_mapping: torch.Tensor  # (T,) int64: block_id * block_size + offset; padding tokens point into block 0
    query_start_loc: torch.Tensor  # (B+1,) int32: sequence b owns rows [qsl[b], qsl[b+1]); qsl[B] == T
    seq_lens: torch.Tensor  # (B,) int32: context length after this step, >= 1
    block_tables: torch.Tensor  # (B, max_blocks) int32: block ids in order, unused entries 0
    max_query_len: int  # host int: most query tokens of one sequence in this step
    max_seq_len: int  # host int: upper bound of seq_lens (<= max_blocks * block_size)
    # (B,) int32 sequence ids, longest context first: the CUDA decode kernel's launch order. None until the first
    # layer of a step that needs it computes it on the device; the step's other layers reuse it.
    seq_order: torch.Tensor | None = None
