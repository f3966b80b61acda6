"""Per-request edits of a step's logits before sampling: min_tokens stop bans, logit_bias, allowed_token_ids and
bad_words, gathered on the host into a few index tensors and applied on the device in three kernels."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

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


def logit_edits(sampled: Sequence[Request], device: torch.device, first: int = 0) -> LogitEdits | None:
    """The edits for a step's sampled rows (in row order) from row `first` on (the rows before it have none); None
    when no row has any. A bad word whose prefix ends on the token still on the device (the asynchronous pipeline's
    carry-over) is checked there."""
    rows: list[int] = []
    tokens: list[int] = []
    values: list[float] = []
    when: list[int] = []
    allowed_rows: list[int] = []
    allowed_tokens: list[int] = []
    restricted: list[int] = []
    for j in range(first, len(sampled)):
        req = sampled[j]
        if not req.edits_logits:
            continue
        p = req.params
        if p.min_tokens and req.num_output_tokens - 1 < p.min_tokens:  # no stop token before the minimum
            for t in sorted(req.stop_ids):
                rows.append(j), tokens.append(t), values.append(float("-inf")), when.append(_ALWAYS)
        for t, bias in p.logit_bias.items():
            rows.append(j), tokens.append(t), values.append(bias), when.append(_ALWAYS)
        for t, last in _bad_word_bans(req):
            rows.append(j), tokens.append(t), values.append(float("-inf")), when.append(last)
        if p.allowed_token_ids:
            restricted.append(j)
            allowed_rows += [j] * len(p.allowed_token_ids)
            allowed_tokens += p.allowed_token_ids
    if not rows and not restricted:
        return None
    pin = device.type == "cuda"

    def to_device(data: list, dtype: torch.dtype) -> torch.Tensor:
        host = torch.tensor(data, dtype=dtype)
        return (host.pin_memory() if pin else host).to(device, non_blocking=True)

    edits = LogitEdits(None, None, None, None, False, None, None, None)
    if rows:
        index = to_device([rows, tokens, when], torch.int64)
        edits.rows, edits.tokens, edits.when_last = index[0], index[1], index[2]
        edits.values = to_device(values, torch.float32)
        edits.conditional = any(w != _ALWAYS for w in when)
    if restricted:
        pairs = to_device([allowed_rows, allowed_tokens], torch.int64)
        edits.allowed_rows, edits.allowed_tokens = pairs[0], pairs[1]
        edits.restricted_rows = to_device(restricted, torch.int64)
    return edits


def _bad_word_bans(req: Request) -> list[tuple[int, int]]:
    """(token, required last token) for each bad word whose next token would complete it; the required last token
    is _ALWAYS when the host already knows the tokens before it."""
    if not req.bad_word_ids:
        return []
    known = req.output_token_ids
    unknown = req.num_pending - 1  # tokens sampled before this step and not read back yet (0 or 1)
    bans = []
    for word in req.bad_word_ids:
        prefix, last = word[:-1], word[-1]
        if not prefix:
            bans.append((last, _ALWAYS))
        elif len(known) + unknown < len(prefix):
            continue
        elif unknown == 0:
            if known[len(known) - len(prefix):] == prefix:
                bans.append((last, _ALWAYS))
        else:  # the prefix's last token is the one on the device: the device checks it
            head = prefix[:-1]
            if not head or known[len(known) - len(head):] == head:
                bans.append((last, prefix[-1]))
    return bans
