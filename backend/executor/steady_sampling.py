"""The steady rows' sampling settings, filled from the requests once per steady-batch version, not once a step."""
from __future__ import annotations

import numpy as np

from backend.core.steady_batch import SteadyBatch
from backend.executor.sampler import fill_host_rows


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
    """Per-row settings of a steady batch's rows, kept while its rows stay the same (one version).

    Within a version only each row's step index moves, by one a step for every row, as its token count does: the
    step index is the kept one plus how far the row's count moved since. Reading every request's parameters for
    256 rows costs a few hundred microseconds of Python a step; copying the kept arrays costs a few."""

    def __init__(self) -> None:
        self._batch: SteadyBatch | None = None
        self._version = -1
        self._f = self._k = self._seeds = self._steps = self._computed = None
        self._flags: dict = {}

    def fill(self, sb: SteadyBatch, host_f: np.ndarray, host_i: np.ndarray, host_k: np.ndarray) -> dict:
        """Write the settings of sb's rows into host arrays (6, n) f32, (2, n) i64, (n,) i32; return their flags."""
        if sb is not self._batch or sb.version != self._version:
            reqs = sb.requests
            self._flags = fill_host_rows([r.params for r in reqs], [r.seed for r in reqs],
                                         [r.num_output_tokens - 1 for r in reqs], host_f, host_i, host_k)
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
