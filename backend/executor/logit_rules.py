"""Per-request edits of a step's logits before sampling: min_tokens stop bans, logit_bias, allowed_token_ids and
bad_words, gathered on the host into a few index tensors and applied on the device in three kernels."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from backend.core.row_state import RowState
from backend.core.running_batch import RunningBatch
from backend.request import Request

_ALWAYS = -1  # an edit that holds whatever the row's last token is


@dataclass(slots=True)
class LogitEdits:
    """One step's edits on the device: additions to (row, token) logits, some only when the row's last token is a
    given one, and rows restricted to an allowed set of tokens."""

    rows: torch.Tensor | None  # (m,) int64 sampled-row index
    tokens: torch.Tensor | None  # (m,) int64
    values: torch.Tensor | None  # (m,) f32 added to the logit (-inf bans it)
    when_last: torch.Tensor | None  # (m,) int64: the row's last token must be this, or _ALWAYS
    conditional: bool  # some edit depends on the row's last token (a bad word whose prefix ends on the device)
    allowed_rows: torch.Tensor | None  # (a,) int64, with allowed_tokens: (row, token) pairs kept
    allowed_tokens: torch.Tensor | None
    restricted_rows: torch.Tensor | None  # (r,) int64: the rows with an allowed set

    def apply(self, logits: torch.Tensor, last_tokens: Callable[[], torch.Tensor]) -> None:
        """Edit logits (N, V) in place; last_tokens() gives each sampled row's last fed token (N,) on the device."""
        if self.restricted_rows is not None:
            keep = logits[self.allowed_rows, self.allowed_tokens]
            logits[self.restricted_rows] = float("-inf")
            logits[self.allowed_rows, self.allowed_tokens] = keep
        if self.rows is None:
            return
        values = self.values
        if self.conditional:
            holds = (self.when_last == _ALWAYS) | (last_tokens()[self.rows] == self.when_last)
            values = torch.where(holds, values, torch.zeros_like(values))
        logits.index_put_((self.rows, self.tokens), values.to(logits.dtype), accumulate=True)


@dataclass(frozen=True, slots=True)
class FixedEdits:
    """A request's edits that hold at every step: logit_bias, bad words of one token, its allowed set."""

    tokens: list[int]
    values: list[float]
    allowed: list[int]


def fixed_edits(req: Request) -> FixedEdits | None:
    """req's fixed edits; None for a request that edits no logits (Request.edits_logits)."""
    if not req.edits_logits:
        return None
    p = req.params
    tokens, values = list(p.logit_bias), list(p.logit_bias.values())
    for word in req.bad_word_ids:
        if len(word) == 1:
            tokens.append(word[0])
            values.append(float("-inf"))
    return FixedEdits(tokens, values, list(p.allowed_token_ids))


@dataclass(slots=True)
class EditLists:
    """A step's edits gathered on the host, row by row, before they go to the device as a few index tensors."""

    rows: list[int]
    tokens: list[int]
    values: list[float]
    when: list[int]
    allowed_rows: list[int]
    allowed_tokens: list[int]
    restricted: list[int]

    @classmethod
    def empty(cls) -> "EditLists":
        return cls([], [], [], [], [], [], [])

    def __bool__(self) -> bool:
        return bool(self.rows or self.restricted)

    def add(self, j: int, req: Request, fixed: FixedEdits) -> None:
        """Sampled row j's edits: its fixed ones, min_tokens stop bans and the bans of bad words of several tokens
        (they follow its tokens)."""
        if fixed.tokens:
            n = len(fixed.tokens)
            self.rows += [j] * n
            self.tokens += fixed.tokens
            self.values += fixed.values
            self.when += [_ALWAYS] * n
        if fixed.allowed:
            self.restricted.append(j)
            self.allowed_rows += [j] * len(fixed.allowed)
            self.allowed_tokens += fixed.allowed
        p = req.params
        if p.min_tokens and req.num_output_tokens - 1 < p.min_tokens:  # no stop token before the minimum
            for t in sorted(req.stop_ids):
                self._edit(j, t, float("-inf"), _ALWAYS)
        for t, last in _bad_word_bans(req):
            self._edit(j, t, float("-inf"), last)

    def _edit(self, row: int, token: int, value: float, when: int) -> None:
        self.rows.append(row)
        self.tokens.append(token)
        self.values.append(value)
        self.when.append(when)

    def to_device(self, device: torch.device) -> LogitEdits:
        """The gathered edits as LogitEdits on the device (pinned host copies on CUDA, so the uploads don't block)."""
        pin = device.type == "cuda"

        def upload(data: list, dtype: torch.dtype) -> torch.Tensor:
            host = torch.tensor(data, dtype=dtype)
            return (host.pin_memory() if pin else host).to(device, non_blocking=True)

        edits = LogitEdits(None, None, None, None, False, None, None, None)
        if self.rows:
            index = upload([self.rows, self.tokens, self.when], torch.int64)
            edits.rows, edits.tokens, edits.when_last = index[0], index[1], index[2]
            edits.values = upload(self.values, torch.float32)
            edits.conditional = any(w != _ALWAYS for w in self.when)
        if self.restricted:
            pairs = upload([self.allowed_rows, self.allowed_tokens], torch.int64)
            edits.allowed_rows, edits.allowed_tokens = pairs[0], pairs[1]
            edits.restricted_rows = upload(self.restricted, torch.int64)
        return edits


class RowLogitEdits(RowState):
    """The decode rows' fixed edits (FixedEdits), kept per row and following the running batch's row changes, so a
    step reads only its editing rows' moving edits (min_tokens bans, bad words of several tokens) from them."""

    def __init__(self) -> None:
        super().__init__()
        self._entries: list[FixedEdits | None] = []
        self._editing: list[int] = []  # the rows whose entry is not None

    def gather(self, rb: RunningBatch, lists: EditLists) -> None:
        """The edits of rb's rows (the step's first sampled rows, in row order) into lists."""
        if not rb.any_edits_logits:  # nothing to read or follow
            return
        self.follow(rb)
        requests, entries = rb.requests, self._entries
        for j in self._editing:
            lists.add(j, requests[j], entries[j])

    def _read(self, reqs: list) -> list[FixedEdits | None]:
        return [fixed_edits(req) for req in reqs]

    def _reset(self, entries: list[FixedEdits | None]) -> None:
        self._entries = entries

    def _take(self, order) -> None:
        entries = self._entries
        self._entries = [entries[i] for i in order.tolist()]

    def _append(self, entries: list[FixedEdits | None]) -> None:
        self._entries = self._entries + entries

    def _changed(self) -> None:
        self._editing = [j for j, entry in enumerate(self._entries) if entry is not None]


def step_logit_edits(rows: RowLogitEdits, rb: RunningBatch, sampled: Sequence[Request], device: torch.device
                     ) -> LogitEdits | None:
    """The edits for a step's sampled rows (in row order): the decode rows' (rb's rows, leading them) kept per row,
    the prefill rows' read from their requests; None when no row has any. A bad word whose prefix ends on the
    token still on the device (the asynchronous pipeline's carry-over) is checked there."""
    lists = EditLists.empty()
    rows.gather(rb, lists)
    for j in range(len(rb), len(sampled)):
        req = sampled[j]
        if req.edits_logits:
            lists.add(j, req, fixed_edits(req))
    return lists.to_device(device) if lists else None


def _bad_word_bans(req: Request) -> list[tuple[int, int]]:
    """(token, required last token) for each bad word of several tokens whose next token would complete it; the
    required last token is _ALWAYS when the host already knows the tokens before it (a bad word of one token is a
    fixed edit: FixedEdits)."""
    if not req.bad_word_ids:
        return []
    known = req.output_token_ids
    unknown = req.num_pending - 1  # tokens sampled before this step and not read back yet (0 or 1)
    bans = []
    for word in req.bad_word_ids:
        prefix, last = word[:-1], word[-1]
        if not prefix or len(known) + unknown < len(prefix):
            continue
        if unknown == 0:
            if known[len(known) - len(prefix):] == prefix:
                bans.append((last, _ALWAYS))
        else:  # the prefix's last token is the one on the device: the device checks it
            head = prefix[:-1]
            if not head or known[len(known) - len(head):] == head:
                bans.append((last, prefix[-1]))
    return bans
