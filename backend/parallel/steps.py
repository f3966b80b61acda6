"""The messages rank 0 broadcasts to its workers: a header saying what to run, then that step's inputs.

Each message is an int64 header of HEADER_LEN values, [op, sizes...], and for a forward step one int64 payload
holding every input tensor end to end, so a step costs two broadcasts whatever its shape.
"""
from __future__ import annotations

import torch

from backend.ops.torch.attention import AttentionMetadata

HEADER_LEN = 8
OP_STOP = 0  # the engine stopped: leave the loop
OP_CACHE = 1  # [op, num_blocks, block_size]: allocate this rank's KV cache
OP_FORWARD = 2  # [op, tokens, sequences, table width, max query len, max seq len]: run the layers
OP_LOGITS = 3  # [op, rows]: the LM head over these hidden rows (broadcast next), gathered on rank 0


def header(op: int, *values: int) -> torch.Tensor:
    h = torch.zeros(HEADER_LEN, dtype=torch.int64)
    h[0] = op
    h[1:1 + len(values)] = torch.tensor(values, dtype=torch.int64)
    return h


def pack_forward(input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(header, payload) of a forward step: ids, positions, KV slots, query starts, sequence lengths, block tables."""
    t, s = input_ids.numel(), meta.seq_lens.numel()
    width = meta.block_tables.shape[1]
    payload = torch.cat([input_ids, positions, meta.slot_mapping, meta.query_start_loc.to(torch.int64),
                         meta.seq_lens.to(torch.int64), meta.block_tables.reshape(-1).to(torch.int64)])
    return header(OP_FORWARD, t, s, width, meta.max_query_len, meta.max_seq_len), payload


def forward_payload_len(h: torch.Tensor) -> int:
    t, s, width = (int(v) for v in h[1:4])
    return 3 * t + (s + 1) + s + s * width


def unpack_forward(h: torch.Tensor, payload: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(input_ids, positions, metadata) from a forward step's header and payload."""
    t, s, width, max_query_len, max_seq_len = (int(v) for v in h[1:6])
    ids, positions, slots, starts, lens, tables = payload.split([t, t, t, s + 1, s, s * width])
    meta = AttentionMetadata(slot_mapping=slots, query_start_loc=starts.to(torch.int32),
                             seq_lens=lens.to(torch.int32),
                             block_tables=tables.to(torch.int32).view(s, width),
                             max_query_len=max_query_len, max_seq_len=max_seq_len)
    return ids, positions, meta
