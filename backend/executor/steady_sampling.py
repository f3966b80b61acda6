"""The steady rows' sampling settings, kept per row as the rows change, not read from every request each step."""
from __future__ import annotations

import numpy as np

from backend.core.steady_batch import SteadyBatch
from backend.executor.sampler import fill_request_rows, row_flags

_NO_LOGPROBS = -1  # steady rows never ask for logprobs (SteadyBatch.eligible)


def merge_flags(a: dict, b: dict) -> dict:
    """The host flags of rows a followed by rows b (fill_host_rows' flags of each part)."""
    return dict(
        all_greedy=a["all_greedy"] and b["all_greedy"],
        any_top_k=a["any_top_k"] or b["any_top_k"],
        max_top_k=max(a["max_top_k"], b["max_top_k"]),
        any_top_p=a["any_top_p"] or b["any_top_p"],
        any_min_p=a["any_min_p"] or b["any_min_p"],
        any_penalty=a["any_penalty"] or b["any_penalty"],
        num_logprobs=max(a["num_logprobs"], b["num_logprobs"]),
    )


class SteadySamplingRows:
    """Per-row settings of a steady batch's rows, kept while its rows stay the same and following them as they change.

    Within a version only each row's step index moves, by one a step for every row, as its token count does: the
    step index is the kept one plus how far the row's count moved since. When rows leave or join, the kept arrays
    follow the batch's recorded changes (rows dropped by their mask, joiners' settings read and added at the end),
    so only the joiners' requests are read. Reading every request's parameters for 256 rows costs a few hundred
    microseconds of Python; following a change costs a few."""

    def __init__(self) -> None:
        self._batch: SteadyBatch | None = None
        self._version = -1
        self._f = self._k = self._seeds = self._steps = self._computed = None
        self._flags: dict = {}

    def fill(self, sb: SteadyBatch, host_f: np.ndarray, host_i: np.ndarray, host_k: np.ndarray) -> dict:
        """Write the settings of sb's rows into host arrays (6, n) f32, (2, n) i64, (n,) i32; return their flags."""
        if sb is not self._batch or (sb.version != self._version and not self._follow(sb)):
            self._flags = fill_request_rows(sb.requests, host_f, host_i, host_k)
            self._batch, self._version = sb, sb.version
            self._f, self._k = host_f.copy(), host_k.copy()
            self._seeds, self._steps = host_i[0].copy(), host_i[1].copy()
            self._computed = sb.computed.copy()
            return self._flags
        host_f[:] = self._f
        host_k[:] = self._k
        host_i[0] = self._seeds
        np.add(self._steps, sb.computed - self._computed, out=host_i[1])
        return self._flags

    def _follow(self, sb: SteadyBatch) -> bool:
        """Bring the kept arrays from their version to sb's through sb's recorded changes; False when one of them is
        no longer recorded (then every row is read again)."""
        changes = sb.changes_since(self._version)
        if changes is None:
            return False
        for kind, change in changes:
            if kind == "keep":
                keep = change
                self._f, self._k = self._f[:, keep], self._k[keep]
                self._seeds, self._steps, self._computed = self._seeds[keep], self._steps[keep], self._computed[keep]
            else:
                self._add_rows(change)
        self._flags = row_flags(self._f, self._k, _NO_LOGPROBS)
        self._version = sb.version
        return True

    def _add_rows(self, reqs: list) -> None:
        """The joiners' settings, read from them now with their step index and token count of now (which move
        together from here, as the kept rows' do)."""
        m = len(reqs)
        f = np.empty((self._f.shape[0], m), dtype=self._f.dtype)
        i = np.empty((2, m), dtype=self._seeds.dtype)
        k = np.empty(m, dtype=self._k.dtype)
        fill_request_rows(reqs, f, i, k)
        computed = np.fromiter((r.num_computed_tokens for r in reqs), dtype=self._computed.dtype, count=m)
        self._f = np.concatenate([self._f, f], axis=1)
        self._k = np.concatenate([self._k, k])
        self._seeds = np.concatenate([self._seeds, i[0]])
        self._steps = np.concatenate([self._steps, i[1]])
        self._computed = np.concatenate([self._computed, computed])
