"""The token tables penalties read (each sampled row's prompt and outputs), with the decode rows' kept per row."""
from __future__ import annotations

import numpy as np

from backend.core.row_state import RowState
from backend.core.running_batch import RunningBatch
from backend.request import Request


def prompt_tokens(req: Request) -> np.ndarray:
    """req's prompt as int64 (the array made off the loop where there is one)."""
    return req.prompt_array if req.prompt_array is not None else np.asarray(req.prompt_token_ids, dtype=np.int64)


def outputs_before_input(req: Request) -> int:
    """How many of req's outputs come before this step's input token (that one is added on the device, carried over
    or not)."""
    return max(0, req.num_computed_tokens - 1 - req.num_prompt_tokens)


class RowPenaltyTokens(RowState):
    """The decode rows' prompt and output tokens as int64 arrays, kept per row and following the running batch's row
    changes: a step copies only the outputs each row made since the last, not every row's whole token lists."""

    def __init__(self) -> None:
        super().__init__()
        self._prompts: list[np.ndarray] = []
        self._outputs: list[np.ndarray] = []  # per row a buffer (its capacity doubles) of which _counts are filled
        self._counts: list[int] = []

    def tables(self, rb: RunningBatch) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Each row's prompt and its outputs before this step's input token (new lists of the kept arrays)."""
        self.follow(rb)
        outputs, counts = self._outputs, self._counts
        seen = []
        for j, req in enumerate(rb.requests):
            k, have = outputs_before_input(req), counts[j]
            if k > have:
                buf = outputs[j]
                if k > len(buf):
                    outputs[j] = grown = np.empty(max(2 * len(buf), k), dtype=np.int64)
                    grown[:have] = buf[:have]
                    buf = grown
                buf[have:k] = req.output_token_ids[have:k]
                counts[j] = k
            seen.append(outputs[j][:k])
        return list(self._prompts), seen

    def _read(self, reqs: list) -> tuple[list, list, list]:
        return [prompt_tokens(r) for r in reqs], [np.empty(64, dtype=np.int64) for _ in reqs], [0] * len(reqs)

    def _reset(self, entries: tuple[list, list, list]) -> None:
        self._prompts, self._outputs, self._counts = entries

    def _take(self, order) -> None:
        rows = order.tolist()
        self._prompts = [self._prompts[i] for i in rows]
        self._outputs = [self._outputs[i] for i in rows]
        self._counts = [self._counts[i] for i in rows]

    def _append(self, entries: tuple[list, list, list]) -> None:
        prompts, outputs, counts = entries
        self._prompts += prompts
        self._outputs += outputs
        self._counts += counts
