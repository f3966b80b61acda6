"""SamplingParams (validated user settings), Request (engine-side state) and RequestOutput (what callers see)."""
from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field, fields
from typing import Any

from backend.structured.spec import StructuredOutputs, parse_structured_outputs

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_ABORT = "abort"
FINISH_ERROR = "error"

MAX_LOGPROBS = 20
MAX_SAMPLES = 64  # n: samples of one prompt
MAX_LOGIT_BIAS = 100.0  # |bias| is clamped to this, as vLLM does
MAX_SEED = 2**64 - 1  # the sampler's generator keys on a 64-bit seed (executor/sampler.py); larger ones would wrap


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens and when to stop; names follow vLLM so Triton's vLLM clients work unchanged."""

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0  # 0 = greedy
    top_k: int = -1  # -1 or 0 = all tokens
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # > 1 discourages tokens seen in prompt or output
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; 0: the sampled token's; n: and the top n
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    n: int = 1  # samples of the prompt, sharing its KV blocks
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    allowed_token_ids: list[int] = field(default_factory=list)  # non-empty: sample only among these
    bad_words: list[str] = field(default_factory=list)  # never generated (each as text, with and without a space)
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last k tokens
    # a JSON schema, regex, choice or grammar the output must follow (backend/structured): the value a client sends
    # (a JSON string or an object), parsed into StructuredOutputs
    structured_outputs: StructuredOutputs | None = None
    speculate: bool = True  # false: this request's rows take no drafted tokens where the engine speculates

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        if isinstance(self.logit_bias, dict):  # JSON object keys are strings: {"50256": -100}
            self.logit_bias = {_token_key(k): v for k, v in self.logit_bias.items()}
        if not isinstance(self.structured_outputs, StructuredOutputs):
            self.structured_outputs = parse_structured_outputs(self.structured_outputs)
        self.validate()

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "SamplingParams":
        """Build from a JSON object; unknown keys are rejected, not ignored."""
        if not isinstance(values, dict):
            raise ValueError("sampling parameters must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s) {unknown}; allowed: {sorted(known)}")
        return cls(**values)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        """Raise ValueError naming the field and the allowed range."""
        _int("max_tokens", self.max_tokens, 1)
        _int("min_tokens", self.min_tokens, 0)
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        _float("temperature", self.temperature, 0.0, 100.0)
        _int("top_k", self.top_k, -1)
        _float("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _float("min_p", self.min_p, 0.0, 1.0)
        _float("repetition_penalty", self.repetition_penalty, 0.0, 10.0, low_open=True)
        _float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError("stop must be a string or a list of non-empty strings")
        if not isinstance(self.stop_token_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids
        ):
            raise ValueError("stop_token_ids must be a list of non-negative integers")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "speculate"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.logprobs is not None:
            _int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        _int("n", self.n, 1, MAX_SAMPLES)
        if self.seed is not None:
            _seed(self.seed, self.n)
        if not isinstance(self.logit_bias, dict):
            raise ValueError("logit_bias must be an object of token id -> bias")
        for token, bias in self.logit_bias.items():
            _float(f"logit_bias[{token}]", bias, -math.inf, math.inf)
            self.logit_bias[token] = max(-MAX_LOGIT_BIAS, min(MAX_LOGIT_BIAS, float(bias)))
        if not isinstance(self.allowed_token_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.allowed_token_ids
        ):
            raise ValueError("allowed_token_ids must be a list of non-negative integers")
        if not isinstance(self.bad_words, list) or not all(isinstance(w, str) and w.strip() for w in self.bad_words):
            raise ValueError("bad_words must be a string or a list of non-empty strings")
        if self.truncate_prompt_tokens is not None:
            _int("truncate_prompt_tokens", self.truncate_prompt_tokens, 1)

    @property
    def has_logit_rules(self) -> bool:
        """Edits of the logits beyond temperature and penalties: biases, an allowed set, banned words."""
        return bool(self.logit_bias or self.allowed_token_ids or self.bad_words)

    def check_limits(self, max_stop_strings: int, max_stop_string_length: int, vocab_size: int) -> None:
        """Checks that depend on the engine's configuration and model."""
        if len(self.stop) > max_stop_strings:
            raise ValueError(f"stop: at most {max_stop_strings} stop strings are allowed, got {len(self.stop)}")
        for s in self.stop:
            if len(s) > max_stop_string_length:
                raise ValueError(f"stop: each stop string must be at most {max_stop_string_length} characters")
        for name, ids in (("stop_token_ids", self.stop_token_ids), ("allowed_token_ids", self.allowed_token_ids),
                          ("logit_bias", list(self.logit_bias))):
            for t in ids:
                if t >= vocab_size:
                    raise ValueError(f"{name}: {t} is outside the vocabulary [0, {vocab_size})")


def penalised(p: SamplingParams) -> bool:
    """Repetition, presence or frequency penalties: the sampler reads the row's prompt and output tokens."""
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _token_key(key: Any) -> int:
    """A logit_bias key: a token id, as an int or the string JSON object keys are."""
    if isinstance(key, str) and key.strip().isdigit():
        return int(key)
    if isinstance(key, int) and not isinstance(key, bool) and key >= 0:
        return key
    raise ValueError(f"logit_bias keys must be token ids, got {key!r}")


def _finite(value: int | float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int beyond float's range
        return False


def _short(value: Any) -> str:
    """repr(value), cut to 60 characters (a 4,000-digit number is not worth echoing)."""
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:40]}... ({len(text)} characters)"


def _int(name: str, value: Any, low: int, high: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {_short(value)}")
    if value < low or (high is not None and value > high):
        rng = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be {rng}, got {_short(value)}")


def _seed(seed: Any, n: int) -> None:
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"seed must be an integer, got {_short(seed)}")
    if not 0 <= seed <= MAX_SEED:
        raise ValueError(f"seed must be in [0, {MAX_SEED}] (0 to 2**64 - 1, the generator's 64-bit range), "
                         f"got {_short(seed)}")
    if seed + n - 1 > MAX_SEED:  # sample i is seeded seed + i
        raise ValueError(f"seed + n - 1 must be at most {MAX_SEED} (sample i is seeded seed + i), got seed "
                         f"{seed} with n {n}")


def _float(name: str, value: Any, low: float, high: float, low_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite(value):
        raise ValueError(f"{name} must be a finite number, got {_short(value)}")
    if (value <= low if low_open else value < low) or value > high:
        rng = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
        raise ValueError(f"{name} must be in {rng}, got {_short(value)}")


class RequestStatus(enum.Enum):
    """Where a request is in its life."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Request:
    """Engine-side state of one request; touched only by the engine thread."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    eos_token_ids: frozenset[int]
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[Any] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # prefix-cache hash of each full block, in order
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    finish_reason: str | None = None
    blocks_freed: bool = False
    num_preemptions: int = 0
    first_token_time: float | None = None
    # counters kept in step with the lists (read every step for every request, so not recomputed)
    num_prompt_tokens: int = 0
    # greedy, no logprobs, penalties or min_tokens: a decode graph's own argmax is its final token
    plain_greedy: bool = False
    stop_ids: frozenset[int] = frozenset()  # tokens that end the request: stop_token_ids, and EOS unless ignored
    # the caller wants the final output only and nothing needs per-token work (stop strings, logprobs): the loop
    # sends no per-step events for it, only the final one with all its tokens
    final_only: bool = False
    # n > 1: the caller's id for all samples, and which sample this is (outputs carry both)
    group_id: str = ""
    sample_index: int = 0
    # samples that wait for this one's prompt: once its last prompt chunk is scheduled they share its KV blocks
    forks: list["Request"] = field(default_factory=list)
    bad_word_ids: list[list[int]] = field(default_factory=list)  # bad_words as token sequences
    edits_logits: bool = False  # min_tokens, logit_bias, allowed_token_ids or bad_words: see logit_rules
    # its decode rows may take drafted tokens (backend/speculative): not with logit edits (min_tokens bans move with
    # the output count), nor where the request turned speculation off; a grammar's masks and the penalties' token
    # tables follow the drafts (TokenMasker.fill_drafted, verify.expand_rows)
    may_speculate: bool = False
    # structured outputs: the compiled constraint (made in the caller's thread), and this sample's matcher, made
    # when its first token is masked and advanced by every token it accepts
    grammar: Any = None
    matcher: Any = None
    # made where the request is made, in the caller's thread (BlockManager.prepare_prompt), so the loop neither
    # converts nor hashes a prompt: the prompt as an int64 array (prefill chunks copy from it), and (block size,
    # the chained prefix-cache hash of each full prompt block); None: made by the loop when first needed
    prompt_array: Any = None
    prompt_hashes: tuple[int, list[int]] | None = None
    # the token counts and newest step (num_computed_tokens, num_tokens, last_step_id), stored here while the
    # request is no decode row; while it is one, the running batch counts them for all its rows at once (one add a
    # step, not one per row): `row_batch` is that batch, _computed the request's offset from the batch's count of steps
    row_batch: Any = field(default=None, init=False)
    _computed: int = field(default=0, init=False)
    _tokens: int = field(default=0, init=False)
    _last_step_id: int = field(default=-1, init=False)

    @property
    def num_computed_tokens(self) -> int:
        """Tokens whose KV is written or queued to be written."""
        rows = self.row_batch
        return self._computed if rows is None else rows.advances + self._computed

    @num_computed_tokens.setter
    def num_computed_tokens(self, value: int) -> None:
        rows = self.row_batch
        self._computed = value if rows is None else value - rows.advances

    @property
    def num_tokens(self) -> int:
        """Prompt + outputs + tokens still on the device (num_pending). A decode row holds exactly one token it has
        not fed yet: the one it sampled last."""
        return self._tokens if self.row_batch is None else self.num_computed_tokens + 1

    @num_tokens.setter
    def num_tokens(self, value: int) -> None:
        if self.row_batch is not None:
            raise RuntimeError(f"request {self.request_id}: a decode row's token count follows its batch")
        self._tokens = value

    @property
    def last_step_id(self) -> int:
        """The newest step that holds this request (it may still be on the device)."""
        return self._last_step_id if self.row_batch is None else self.row_batch.last_step_id

    @last_step_id.setter
    def last_step_id(self, value: int) -> None:
        if self.row_batch is not None:
            raise RuntimeError(f"request {self.request_id}: a decode row's newest step is its batch's")
        self._last_step_id = value

    def join_rows(self, rows: Any) -> None:
        """The request becomes a decode row of `rows` (a RunningBatch): from now on the batch counts for it."""
        self._computed -= rows.advances
        self.row_batch = rows

    def leave_rows(self) -> None:
        """The request is no decode row any more: its counts, as the batch kept them, are stored here again."""
        rows = self.row_batch
        if rows is not None:
            computed = self.num_computed_tokens
            self.row_batch = None
            self._computed, self._tokens, self._last_step_id = computed, computed + 1, rows.last_step_id

    def __post_init__(self) -> None:
        p = self.params
        self.plain_greedy = (p.temperature == 0.0 and p.logprobs is None and p.min_tokens == 0
                             and not penalised(p) and not p.has_logit_rules and self.grammar is None)
        self.edits_logits = bool(p.min_tokens) or p.has_logit_rules
        self.may_speculate = p.speculate and not self.edits_logits
        if not self.group_id:
            self.group_id = self.request_id
        self.stop_ids = frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else self.eos_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.num_tokens = self.num_prompt_tokens + len(self.output_token_ids)

    @property
    def num_pending(self) -> int:
        """Tokens sampled on the device but not read back yet (0, 1, or 2 while two steps are queued)."""
        return self.num_tokens - self.num_prompt_tokens - len(self.output_token_ids)

    def add_pending(self) -> None:
        """A queued step will sample this request's next token."""
        self.num_tokens += 1

    def accept_token(self, token: int) -> None:
        """A pending token arrived on the host."""
        self.output_token_ids.append(token)

    def drop_pending(self) -> None:
        """A pending token arrived after the request finished: it is not part of the output."""
        self.num_tokens -= 1

    @property
    def num_output_tokens(self) -> int:
        """Outputs + tokens still on the device."""
        return self.num_tokens - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def token_slice(self, start: int, end: int) -> list[int]:
        """Known tokens [start, end) of prompt + outputs, without copying the whole of both lists."""
        n = self.num_prompt_tokens
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]


@dataclass(slots=True)
class RequestOutput:
    """One update of a request: the new tokens and text since the last update, and the totals."""

    request_id: str
    all_token_ids: list[int]  # the request's growing token list, shared by its updates: read token_ids
    text: str  # all output text so far
    delta_token_ids: list[int]
    delta_text: str
    finished: bool = False
    finish_reason: str | None = None  # stop | length | abort | error
    num_prompt_tokens: int = 0
    num_tokens: int = -1  # output tokens as of this update (-1: all of all_token_ids)
    logprobs: list[dict[str, Any]] | None = None  # one entry per output token when asked
    delta_logprobs: list[dict[str, Any]] | None = None
    error: str | None = None  # message when finish_reason == "error"
    invalid_request: bool = False  # that error is the request's own (its settings conflict), not the engine's
    num_cached_tokens: int = 0
    index: int = 0  # which sample of the request (n > 1); request_id is the caller's, shared by all samples
    first_token_time: float | None = None  # final outputs: time.monotonic() when the engine read the first token

    @property
    def token_ids(self) -> list[int]:
        """All output tokens as of this update (a copy made on access, so streaming updates stay cheap)."""
        return self.all_token_ids[:self.num_tokens] if self.num_tokens >= 0 else list(self.all_token_ids)
