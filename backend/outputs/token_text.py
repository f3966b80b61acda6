"""One token's text, for the logprobs output's decoded_token: decoded by the rule the request's text follows."""
from __future__ import annotations

import functools
from typing import Any, Callable

from backend.outputs.detokenizer import _decoder


class TokenTexts:
    """Cached texts of single tokens, one cache per skip_special_tokens setting.

    With skip_special_tokens (the default) the text leaves special tokens out (an ending <|im_end|>), so their
    decoded_token is "" too, as vLLM's is; without it they keep their names. The same decoder as the text's
    (detokenizer.py) decodes them."""

    def __init__(self, tokenizer: Any, maxsize: int = 1 << 16) -> None:
        decode = _decoder(tokenizer)
        # the same few thousand tokens come back all the time
        self._by_skip = {skip: functools.lru_cache(maxsize=maxsize)(functools.partial(self._one, decode, skip))
                         for skip in (True, False)}

    def decoder(self, skip_special_tokens: bool) -> Callable[[int], str]:
        """token id → its text, as a request with this skip_special_tokens setting shows it."""
        return self._by_skip[bool(skip_special_tokens)]

    @staticmethod
    def _one(decode: Callable[[list[int], bool], str], skip: bool, token: int) -> str:
        return decode([token], skip)
