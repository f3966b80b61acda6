"""Admission checks on the caller's thread: a prompt's token ids (tokenized, truncated, in the vocabulary and
within the model's length and the KV cache) and bad words as token sequences. Every refusal is a ValueError that
says what to change."""
from __future__ import annotations

from typing import Sequence

from backend.config import EngineConfig
from backend.request import SamplingParams

_MAX_CHARS_PER_TOKEN = 64  # a prompt longer than max_model_len x this is refused untokenized


class Admission:
    """Turns a caller's prompt and settings into what a Request holds, or refuses them."""

    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, config: EngineConfig,
                 kv_capacity: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.config = config
        self.kv_capacity = kv_capacity  # tokens the KV cache holds

    def prompt_ids(self, prompt: str | Sequence[int], params: SamplingParams) -> list[int]:
        """The prompt's token ids (truncate_prompt_tokens applied), checked against the limits."""
        token_ids = self._tokenize(prompt, params.truncate_prompt_tokens)
        self._check(token_ids, params)
        return token_ids

    def bad_word_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word as token ids, alone and after a space (mid-text), as vLLM bans them."""
        if not words:
            return []
        if self.tokenizer is None:
            raise ValueError("bad_words needs the model's tokenizer, and this engine has none")
        seqs: list[list[int]] = []
        for word in words:
            plain = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            if plain:
                seqs.append(plain)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            # the spaced form counts when it is another word token of the same length (not a space token + the word)
            if spaced and (not plain or (spaced[0] != plain[0] and len(spaced) == len(plain))):
                seqs.append(spaced)
        return seqs

    def _tokenize(self, prompt: str | Sequence[int], keep_last: int | None = None) -> list[int]:
        """The prompt's token ids; keep_last (truncate_prompt_tokens): only its last keep_last tokens."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            # why: tokenizing megabytes blocks the caller (Triton's execute thread) for seconds; no prompt that
            # fits max_model_len needs more characters than this
            limit = self.max_model_len * _MAX_CHARS_PER_TOKEN
            if len(prompt) > limit:
                raise ValueError(f"prompt has {len(prompt)} characters; at most {limit} are accepted "
                                 f"({_MAX_CHARS_PER_TOKEN} per token of the maximum model length {self.max_model_len})")
            ids = self.tokenizer.encode(prompt)
            if not ids:  # e.g. control characters only, which the tokenizer drops: no token to start from
                raise ValueError("prompt has no tokens: its text tokenizes to nothing")
            return ids[-keep_last:] if keep_last else ids
        ids = list(prompt)[-keep_last:] if keep_last else list(prompt)
        if not ids:
            raise ValueError("prompt token ids are empty")
        if len(ids) >= self.max_model_len:  # before the per-id scan: a huge list is refused at once
            raise ValueError(f"prompt has {len(ids)} token ids; the maximum model length is {self.max_model_len} "
                             "(prompt + max_tokens)")
        vocab = self.vocab_size
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise ValueError(f"token id {t!r} is outside the vocabulary [0, {vocab})")
        return ids

    def _check(self, token_ids: list[int], params: SamplingParams) -> None:
        params.check_limits(self.config.max_stop_strings, self.config.max_stop_string_length, self.vocab_size)
        n = len(token_ids)
        if n + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) exceeds the maximum model length "
                f"({self.max_model_len}); shorten the prompt or lower max_tokens")
        capacity = self.kv_capacity
        if n + params.max_tokens > capacity:
            raise ValueError(
                f"prompt + max_tokens ({n + params.max_tokens} tokens) exceeds the KV cache ({capacity} tokens); "
                f"lower max_tokens or give the engine more KV blocks")
