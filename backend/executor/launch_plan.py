"""How a packed step runs on the device, decided once before anything is queued (ModelRunner.plan)."""
from __future__ import annotations

from dataclasses import dataclass

from backend.executor.logit_rules import LogitEdits
from backend.executor.sampler import SamplingTensors


@dataclass(slots=True)
class LaunchPlan:
    """A step's forward (a decode graph's batch bucket, a mixed graph's token bucket, or eager) and its sampling."""

    bucket: int | None  # the decode graph replayed (rows padded up to it), or None
    tokens: int | None  # the mixed graph replayed (tokens padded up to it), or None
    rows: int  # sampled rows the sampler covers, padding rows included
    logits_rows: int  # with a mixed graph: the logits rows it computes (its sampling padding reaches them)
    sampling: SamplingTensors | None  # None: nothing to sample (partial prefill chunks only), or argmax_only
    edits: LogitEdits | None  # min_tokens bans, logit_bias, allowed_token_ids, bad_words
    width: int  # block-table columns an eager forward reads (a captured graph reads them all)
    max_len: int  # the longest context an eager forward reads
    argmax_only: bool = False  # every row is plain greedy on a decode graph: the graph's argmax is each token
    constrained: bool = False  # some row follows a grammar: its token mask applies before the (eager) sampler

    @property
    def graph(self) -> bool:
        """The forward replays a graph (decode or mixed)."""
        return self.bucket is not None or self.tokens is not None
