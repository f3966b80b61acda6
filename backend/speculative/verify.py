"""Verifying draft tokens: the model samples every drafted position itself, and the drafts that agree are kept.

A row verified with k drafts has k + 1 positions of logits: after its last token, and after each draft. Position i
is sampled exactly as the row's next token would be sampled i steps later without speculation (the same settings,
the seed's noise for step index step + i), so while the drafts agree the tokens kept are the very tokens the model
alone would have made, greedy or sampled, and reproducible per seed. For drafts that are guesses rather than
samples (a one-hot draft distribution: n-gram and suffix proposals), this keeps draft i with probability p(draft i)
and, on a mismatch, the sampled token is a draw from p without the draft: the same law as rejection sampling
(Leviathan et al. 2023; Chen et al. 2023) with q one-hot."""
from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import numpy as np
import torch

from backend.executor.sampler import SamplingTensors, host_to_device


def expand_rows(st: SamplingTensors, positions: int | Sequence[int],
                drafts: Sequence[Sequence[int]] | None = None) -> SamplingTensors:
    """Each row's settings for consecutive tokens, row-major (row 0's positions first): `positions` of them for
    every row, or positions[r] for row r (host ints, so no count is read from the device); the step index grows by
    one a position. With penalties, each row's token tables are repeated too and a position's outputs gain the
    drafts before it, as if they had been made: drafts[r] are row r's (its output table must already hold the
    step's input token)."""
    repeat, step_index = _repeater(st, positions)
    tables = {}
    if st.any_penalty:
        counts = [positions] * st.batch_size if isinstance(positions, int) else list(positions)
        if drafts is None or [1 + len(d) for d in drafts] != counts:
            raise ValueError("rows with penalties need their drafts, one position each after the first")
        rows = st.batch_size  # the tables may hold more rows than the step samples
        tables = dict(prompt_token_ids=repeat(st.prompt_token_ids[:rows]),
                      output_token_ids=torch.cat([repeat(st.output_token_ids[:rows]),
                                                  _drafts_before(drafts, st.step_index.device)], 1))
    return replace(st, temperature=repeat(st.temperature), top_k=repeat(st.top_k), top_p=repeat(st.top_p),
                   min_p=repeat(st.min_p), repetition_penalty=repeat(st.repetition_penalty),
                   presence_penalty=repeat(st.presence_penalty), frequency_penalty=repeat(st.frequency_penalty),
                   seeds=repeat(st.seeds), step_index=step_index, **tables)


def _repeater(st: SamplingTensors, positions: int | Sequence[int]):
    """(a function repeating each row's entry once a position, the positions' step indices)."""
    device = st.step_index.device
    if isinstance(positions, int):
        if positions < 1:
            raise ValueError(f"positions must be >= 1, got {positions}")
        offsets = torch.arange(positions, dtype=st.step_index.dtype, device=device)

        def repeat(t: torch.Tensor) -> torch.Tensor:
            return t.repeat_interleave(positions, dim=0)

        return repeat, (st.step_index.unsqueeze(1) + offsets).reshape(-1)
    counts = list(positions)
    if len(counts) != st.batch_size or min(counts, default=1) < 1:
        raise ValueError(f"need one count >= 1 per row ({st.batch_size} rows), got {counts}")
    total = sum(counts)
    sizes = host_to_device(np.asarray(counts, dtype=np.int64), device)
    starts = host_to_device(np.cumsum([0] + counts[:-1], dtype=np.int64), device)

    def repeat_each(t: torch.Tensor) -> torch.Tensor:
        return t.repeat_interleave(sizes, dim=0, output_size=total)

    within = torch.arange(total, dtype=torch.int64, device=device) - repeat_each(starts)
    return repeat_each, repeat_each(st.step_index) + within.to(st.step_index.dtype)


def _drafts_before(drafts: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    """(positions, longest draft) int64: at row r's position i, its first i drafts, then -1 (no token)."""
    width = max((len(d) for d in drafts), default=0)
    rows = [list(d[:i]) + [-1] * (width - i) for d in drafts for i in range(1 + len(d))]
    return host_to_device(np.asarray(rows, dtype=np.int64).reshape(len(rows), width), device)
