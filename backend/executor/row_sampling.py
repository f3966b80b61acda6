"""The decode rows' sampling settings, kept per row as the rows change, not read from every request each step."""
from __future__ import annotations

import numpy as np

from backend.core.row_state import RowState
from backend.core.running_batch import RunningBatch
from backend.executor.sampler import fill_padding_rows, flags_of_rows, request_columns

_NO_LOGPROBS = -1
# rows of the kept int matrix (request_columns' rows, the step index less the token count; then the logprobs each
# row asks for, _NO_LOGPROBS for none)
_SEED, _STEP_LESS_COUNT, _TOP_K, _CUTOFF, _BITS, _LOGPROBS = range(6)
# plain-greedy rows (Request.plain_greedy) all sample alike: the argmax, whatever their seeds or cutoffs
_PLAIN_GREEDY_FLAGS = flags_of_rows(np.zeros(1, np.int64), np.zeros(1, np.int64), _NO_LOGPROBS)


def fill_plain_greedy_rows(host_f: np.ndarray, host_i: np.ndarray, host_k: np.ndarray) -> dict:
    """Rows of plain-greedy requests: the neutral greedy rows (as padding rows) stand for them; their flags."""
    fill_padding_rows(host_f, host_i, host_k)
    return dict(_PLAIN_GREEDY_FLAGS)


def merge_flags(a: dict, b: dict) -> dict:
    """The host flags of rows a followed by rows b (the flags of each part)."""
    return dict(
        all_greedy=a["all_greedy"] and b["all_greedy"],
        any_top_k=a["any_top_k"] or b["any_top_k"],
        max_top_k=max(a["max_top_k"], b["max_top_k"]),
        any_top_p=a["any_top_p"] or b["any_top_p"],
        any_min_p=a["any_min_p"] or b["any_min_p"],
        any_penalty=a["any_penalty"] or b["any_penalty"],
        num_logprobs=max(a["num_logprobs"], b["num_logprobs"]),
    )


class RowSamplingSettings(RowState):
    """Per-row settings of a running batch's decode rows, kept while its rows stay the same and following them as they
    change.

    Within a version only each row's step index moves, by one a step for every row, as its token count does: the
    kept value is the step index less the token count, and the step index is that plus the count of now. When rows
    leave or join, the kept arrays follow the batch's recorded changes (RowState), so only the joining rows' requests
    are read; the batch's flags come from each row's kept flag bits by one OR and its top-k cutoffs by one max.
    Reading every request's parameters for 256 rows costs a few hundred microseconds of Python; following a change
    costs a few."""

    def __init__(self) -> None:
        super().__init__()
        self._f: np.ndarray | None = None  # (6, rows) float32: the float settings, as request_columns reads them
        # (6, rows) int64: seed, step index less token count, top_k (int32 range), top-k cutoff in force (0: none),
        # flag bits (sampler.request_columns), logprobs asked (-1: none)
        self._i: np.ndarray | None = None
        self._flags: dict = {}

    def fill(self, sb: RunningBatch, host_f: np.ndarray, host_i: np.ndarray, host_k: np.ndarray) -> dict:
        """Write the settings of sb's rows into host arrays (6, n) f32, (2, n) i64, (n,) i32; return their flags."""
        if sb.all_plain_greedy:  # neutral greedy rows stand for them: nothing to read or follow
            return fill_plain_greedy_rows(host_f, host_i, host_k)
        self.follow(sb)
        host_f[:] = self._f
        host_i[0] = self._i[_SEED]
        np.add(self._i[_STEP_LESS_COUNT], sb.computed, out=host_i[1])
        host_k[:] = self._i[_TOP_K]
        return self._flags

    def _read(self, reqs: list) -> tuple[np.ndarray, np.ndarray]:
        """The kept arrays' columns for reqs, read from the requests with their token count of now (the step index
        and the count move together from here, by one a step)."""
        f, i = request_columns(reqs)
        i[_STEP_LESS_COUNT] -= np.fromiter((r.num_computed_tokens for r in reqs), dtype=np.int64, count=len(reqs))
        asked = np.fromiter((_NO_LOGPROBS if r.params.logprobs is None else r.params.logprobs for r in reqs),
                            dtype=np.int64, count=len(reqs))
        return f, np.concatenate([i, asked[None]])

    def _reset(self, entries: tuple[np.ndarray, np.ndarray]) -> None:
        self._f, self._i = entries

    def _take(self, order) -> None:
        self._f, self._i = self._f[:, order], self._i[:, order]

    def _append(self, entries: tuple[np.ndarray, np.ndarray]) -> None:
        f, i = entries
        self._f = np.concatenate([self._f, f], axis=1)
        self._i = np.concatenate([self._i, i], axis=1)

    def _changed(self) -> None:
        self._flags = flags_of_rows(self._i[_BITS], self._i[_CUTOFF], int(self._i[_LOGPROBS].max(initial=_NO_LOGPROBS)))
