"""Incremental detokenization with stop strings: new text per step, never half a character, never past a stop."""
from __future__ import annotations

from typing import Any, Iterable

from backend.request import SamplingParams

_REPLACEMENT = "\ufffd"  # what a decoder yields for an incomplete UTF-8 sequence
_PROMPT_CONTEXT = 5  # prompt tokens decoded in front of the output, so the first token keeps its spacing
_TRIM_AFTER = 256  # drop window ids older than this, so the id list stays short
_MAX_CHAR_TOKENS = 16  # past this many tokens the trailing bytes are invalid, not a partial character: emit


class IncrementalDetokenizer:
    """Turns one request's output tokens into text deltas, applying its stop strings.

    Decoding uses a sliding window (prefix_offset..read_offset..end, as in vLLM/TGI): each step decodes only
    the few tokens since the last emitted text plus a little context, so the cost is O(new tokens).
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Iterable[int], params: SamplingParams):
        self._decode_fn = _decoder(tokenizer)
        self._skip_special = params.skip_special_tokens
        self._stops = list(params.stop)
        self._include_stop = params.include_stop_str_in_output
        context = list(prompt_token_ids)[-(_PROMPT_CONTEXT + 1):]
        self._window: list[int] = context  # context tokens, then decoded output tokens
        self._prefix_offset = 0  # window start of the text that was already turned into a delta
        self._read_offset = len(context)  # window end of that text
        self._held = ""  # decoded text not yet emitted (could begin a stop string)
        self._token_ids: list[int] = []
        self._text = ""
        self._stopped = False
        self._finished = False

    @property
    def stopped(self) -> bool:
        """True once a stop string was found; later tokens add no text."""
        return self._stopped

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return self._text

    @property
    def token_ids(self) -> list[int]:
        """All output tokens accepted so far (including ones excluded from the text)."""
        return self._token_ids

    def stage(self, token_ids: Iterable[int], exclude_from_text: bool = False) -> bool:
        """Accept tokens without decoding; True when there is new text to decode (see windows/apply)."""
        if self._stopped or self._finished:
            return False
        token_ids = list(token_ids)
        self._token_ids.extend(token_ids)
        if exclude_from_text or not token_ids:
            return False
        self._window.extend(token_ids)
        return True

    def windows(self) -> tuple[list[int], list[int]]:
        """The two id windows whose decoded texts `apply` needs: already-emitted context, and all of it."""
        window, prefix, read = self._window, self._prefix_offset, self._read_offset
        return window[prefix:read], window[prefix:]

    @property
    def has_stop_strings(self) -> bool:
        return bool(self._stops)

    @property
    def skip_special_tokens(self) -> bool:
        return self._skip_special

    def apply(self, prefix_text: str, full_text: str, final: bool = False) -> str:
        """Given the decoded windows, advance the offsets and return the new safe text."""
        return self._emit(self._advance(prefix_text, full_text, final))

    def finish(self) -> str:
        """The request ends for another reason (length/EOS/abort): release held-back text, then ''."""
        if self._stopped or self._finished:
            return ""
        delta = self._emit(self._decode_new(final=True))
        self._finished = True
        if self._stopped:
            return delta
        rest, self._held = self._held, ""
        self._text += rest
        return delta + rest

    def decode_windows(self) -> tuple[str, str]:
        """Decode both windows here (the output thread batches them across requests instead)."""
        return self._decode_pair(self.windows())

    def _decode_pair(self, windows: tuple[list[int], list[int]]) -> tuple[str, str]:
        return self._decode(windows[0]), self._decode(windows[1])

    def _decode_new(self, final: bool) -> str:
        """Text of the tokens after read_offset; '' while it ends in a partial character (unless final)."""
        if self._read_offset >= len(self._window):
            return ""
        return self._advance(*self._decode_pair(self.windows()), final)

    def _advance(self, prefix_text: str, full_text: str, final: bool) -> str:
        if self._read_offset >= len(self._window):
            return ""
        pending = len(self._window) - self._read_offset
        if not final and pending <= _MAX_CHAR_TOKENS and (
                len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT)):
            return ""  # wait for the rest of a multi-byte character (bounded, so invalid bytes cannot grow the window)
        self._prefix_offset, self._read_offset = self._read_offset, len(self._window)
        if self._prefix_offset > _TRIM_AFTER:
            del self._window[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return full_text[len(prefix_text):]

    def _emit(self, new_text: str) -> str:
        """Add decoded text to the held text; emit what cannot be part of a stop string."""
        if not new_text:
            return ""
        held = self._held + new_text
        stop = _first_stop(held, self._stops)
        if stop is not None:
            start, end = stop
            out = held[: end if self._include_stop else start]
            self._held, self._stopped = "", True
        else:
            keep = _partial_stop_len(held, self._stops)
            out, self._held = held[: len(held) - keep], held[len(held) - keep:]
        self._text += out
        return out

    def _decode(self, ids: list[int]) -> str:
        return self._decode_fn(ids, self._skip_special)


def _decoder(tokenizer: Any):
    """The Rust decoder of a fast tokenizer (no Python clean-up pass), else the tokenizer's own decode."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return lambda ids, skip: backend.decode(ids, skip_special_tokens=skip)
    return lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def _first_stop(text: str, stops: list[str]) -> tuple[int, int] | None:
    """(start, end) of the stop string that completes first in text (ties: the one starting first)."""
    best = None
    for s in stops:
        i = text.find(s)
        if i >= 0:
            span = (i, i + len(s))
            if best is None or (span[1], span[0]) < (best[1], best[0]):
                best = span
    return best


def _partial_stop_len(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of text that is a proper prefix of some stop string."""
    if not text:
        return 0
    last, longest = text[-1], 0
    for s in stops:
        i = s.rfind(last, 0, len(s) - 1)  # candidate prefixes s[:i + 1] end with text's last character
        while i + 1 > longest:
            if i + 1 <= len(text) and text.endswith(s[: i + 1]):
                longest = i + 1
                break
            i = s.rfind(last, 0, i)
    return longest
