"""The request a caller builds and the pieces of answer the client yields."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(slots=True)
class GenerateRequest:
    """One generation request in the vLLM-backend conventions; None means "server default"."""

    prompt: str = ""
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    stream: bool = True
    exclude_input: bool = True  # answer text only, as a chat user expects
    input_ids: list[int] | None = None  # token-level prompt for clients with their own tokenizer
    return_stats: bool = True  # ask for finish_reason and token counts (optional inputs of the convention)
    return_logprobs: bool = False
    extra: dict[str, Any] = field(default_factory=dict)  # any other vLLM sampling parameter, passed through

    def __post_init__(self):
        if not isinstance(self.prompt, str):
            raise TypeError(f"prompt must be a str, got {type(self.prompt).__name__}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.temperature is not None and self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]


@dataclass(slots=True)
class Chunk:
    """One response of a stream: a text delta plus whatever counts the server attached."""

    text: str = ""
    num_output_tokens: int | None = None  # tokens in this response (a delta when streaming, as vLLM's backend)
    num_input_tokens: int | None = None
    finish_reason: str | None = None
    output_ids: list[int] | None = None
    logprobs: Any = None
    final: bool = False  # the server flagged this response as the request's last

    def tokens(self) -> int:
        """Best count of tokens in this response: reported count, else ids, else 1 per non-empty delta."""
        if self.num_output_tokens is not None:
            return self.num_output_tokens
        if self.output_ids is not None:
            return len(self.output_ids)
        return 1 if self.text else 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(slots=True)
class Result:
    """A whole answer, folded from its chunks, with client-side timings in seconds."""

    text: str = ""
    finish_reason: str | None = None
    num_input_tokens: int | None = None
    num_output_tokens: int = 0
    responses: int = 0
    ttft_s: float | None = None  # request sent → first response carrying a token
    e2e_s: float | None = None  # request sent → last response

    @property
    def itl_s(self) -> float | None:
        """Mean inter-token latency of this request (genai-perf's definition): (e2e − ttft) / (tokens − 1)."""
        if self.ttft_s is None or self.e2e_s is None or self.num_output_tokens < 2 or self.responses < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.num_output_tokens - 1)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "itl_s": self.itl_s}
