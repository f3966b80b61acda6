"""Per-row state kept beside the running batch's decode rows: the one way it follows rows leaving and joining."""
from __future__ import annotations

from backend.core.running_batch import RunningBatch


class RowState:
    """State with one entry per decode row, kept across steps and brought to each new version of the rows through the
    batch's published changes: rows taken in a new order (`_take`), rows appended (`_append`, from `_read` of the
    joining requests). Only joining requests are read; when a change is no longer recorded, every row is read again.
    Subclasses: the rows' sampling settings (executor/row_sampling.py), logit edits (executor/logit_rules.py) and
    penalty token tables (executor/penalty_tokens.py)."""

    def __init__(self) -> None:
        self._batch: RunningBatch | None = None
        self._version = -1

    def follow(self, rb: RunningBatch) -> None:
        """Bring the kept entries to rb's rows as they stand now."""
        if rb is self._batch and rb.version == self._version:
            return
        changes = rb.changes_since(self._version) if rb is self._batch else None
        if changes is None:
            self._reset(self._read(rb.requests))
        else:
            for kind, change in changes:
                if kind == "take":
                    self._take(change.order)
                else:
                    self._append(self._read(change))
        self._batch, self._version = rb, rb.version
        self._changed()

    def _read(self, reqs: list) -> object:
        """The entries of reqs, read from the requests."""
        raise NotImplementedError

    def _reset(self, entries: object) -> None:
        """The entries of every row, read afresh."""
        raise NotImplementedError

    def _take(self, order) -> None:
        """Rows were deleted: entry j is now the one at order[j]."""
        raise NotImplementedError

    def _append(self, entries: object) -> None:
        """Rows joined at the end."""
        raise NotImplementedError

    def _changed(self) -> None:
        """The entries changed (derived values may be refreshed)."""
