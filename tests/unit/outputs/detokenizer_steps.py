"""One detokenizer step as the output processor takes it, for tests that feed tokens one call at a time."""
from __future__ import annotations

from typing import Iterable

from backend.outputs.detokenizer import IncrementalDetokenizer


def add_tokens(detok: IncrementalDetokenizer, token_ids: Iterable[int], exclude_from_text: bool = False) -> str:
    """Stage token_ids, decode the windows and apply them: the text that became safe to emit ('' if none).

    exclude_from_text: the tokens (EOS, a stop token id) join token_ids but their text never appears."""
    if not detok.stage(token_ids, exclude_from_text):
        return ""
    return detok.apply(*detok.decode_windows(), final=False)
