"""Structured outputs on llguidance: constraints compiled for one tokenizer, per-sequence matchers, token masks.

GrammarCompiler turns a StructuredOutputs into a CompiledGrammar (cached by the constraint); each generated sequence
gets its own GrammarMatcher from it; before each sampling step TokenMasker fills one bitmask row per sequence in one
batched call, and apply_token_bitmask sets the logits of the tokens a row may not take to -inf.

EOS is allowed only where the grammar may end. structural_tag takes both of vLLM's forms: the older one with
"triggers" and "structures" (each {"begin", "schema", "end"}): free text in which a trigger starts a tagged segment
whose body follows the schema; and the newer {"type": "structural_tag", "format": {...}}, xgrammar's tree of format
objects, translated by backend/structured/structural_tag.py.
"""
from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import llguidance
import numpy as np
import llguidance.hf
import torch
from llguidance.gbnf_to_lark import gbnf_to_lark

from backend.structured.spec import StructuredOutputs
from backend.structured.structural_tag import Leaves, structural_tag_grammar

MAX_ERROR_CHARS = 2000  # llguidance's messages can carry a dump of the parser state; the first part names the fault
BITS = 32  # tokens per bitmask word

# a GBNF rule definition ("name ::= ..."); Lark writes "name: ...", so any such line marks the grammar as GBNF
_GBNF_RULE = re.compile(r"^\s*[A-Za-z_][A-Za-z0-9_.-]*\s*::=", re.MULTILINE)
# keywords whose value maps names to subschemas, and keywords whose value is a subschema or a list of them
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMAS = ("items", "prefixItems", "additionalItems", "contains", "not", "if", "then", "else", "allOf", "anyOf",
               "oneOf", "additionalProperties", "unevaluatedProperties", "unevaluatedItems", "propertyNames")
_STRUCTURAL_TAG_FORM = ('{"triggers": ["<fn"], "structures": [{"begin": "<fn=name>", "schema": {...}, '
                        '"end": "</fn>"}]}')
_STRUCTURAL_TAG_FORMAT_FORM = '{"type": "structural_tag", "format": {"type": "triggered_tags", ...}}'


class GrammarMatcher:
    """Where one sequence stands in its grammar: which tokens may come next."""

    __slots__ = ("_recorded", "_unrecorded", "ll_matcher")

    def __init__(self, ll_matcher: llguidance.LLMatcher) -> None:
        self.ll_matcher = ll_matcher  # the llguidance matcher; TokenMasker reads its mask
        self._recorded = 0  # tokens llguidance holds in its history (what it can roll back)
        # EOS accepted after the grammar had already stopped: llguidance keeps no record of it, so rollback skips it
        self._unrecorded = 0

    def accept(self, token: int) -> bool:
        """Advance by one token; False (and the matcher is left errored) if the grammar does not allow it."""
        if token < 0:
            raise ValueError(f"token ids are non-negative, got {token}")
        was_stopped = self.ll_matcher.is_stopped()
        if not self.ll_matcher.consume_token(token):
            return False
        if was_stopped:
            self._unrecorded += 1
        else:
            self._recorded += 1
        return True

    @property
    def is_stopped(self) -> bool:
        """The grammar can take no further token (the sequence must end now); also true once errored."""
        return self.ll_matcher.is_stopped()

    @property
    def is_accepting(self) -> bool:
        """The text so far is complete: EOS would be allowed."""
        return self.ll_matcher.is_accepting()

    @property
    def is_error(self) -> bool:
        """A token the grammar does not allow was accepted: the matcher allows nothing more, and cannot roll back."""
        return self.ll_matcher.is_error()

    def rollback(self, n: int) -> None:
        """Undo the last n accepted tokens; ValueError for more than were accepted or for an errored matcher."""
        if n < 0 or n > self._recorded + self._unrecorded:
            raise ValueError(f"cannot roll back {n} tokens: {self._recorded + self._unrecorded} were accepted")
        if self.ll_matcher.is_error():
            raise ValueError("cannot roll back a matcher that refused a token")
        skipped = min(n, self._unrecorded)  # the unrecorded EOS tokens are always the last ones accepted
        self._unrecorded -= skipped
        n -= skipped
        if n and not self.ll_matcher.rollback(n):
            raise ValueError(f"rollback failed: {self.ll_matcher.get_error()[:MAX_ERROR_CHARS]}")
        self._recorded -= n


class CompiledGrammar:
    """A compiled constraint: makes one matcher per generated sequence."""

    __slots__ = ("_template", "spec")

    def __init__(self, spec: StructuredOutputs, template: llguidance.LLMatcher) -> None:
        self.spec = spec
        self._template = template  # never advanced: each matcher starts as a copy of it

    def matcher(self) -> GrammarMatcher:
        """A fresh matcher at the grammar's start."""
        return GrammarMatcher(self._template.deep_copy())


class GrammarCompiler:
    """Compiles StructuredOutputs into grammars for one tokenizer, once per distinct constraint."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_id: int | Iterable[int] | None,
                 cache_size: int = 256) -> None:
        """tokenizer: a Hugging Face fast tokenizer; vocab_size: the logits' width (at least the tokenizer's size);
        eos_token_id: the token(s) allowed where the grammar may end (None: the tokenizer's EOS)."""
        if vocab_size < 1 or cache_size < 1:
            raise ValueError(f"vocab_size and cache_size must be positive, got {vocab_size} and {cache_size}")
        self.vocab_size = vocab_size
        eos = eos_token_id if eos_token_id is None or isinstance(eos_token_id, int) else sorted(eos_token_id)
        try:
            self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
        except ValueError as exc:  # not a fast tokenizer, or more tokens than logits
            raise ValueError(f"structured outputs cannot use this tokenizer ({type(tokenizer).__name__}): "
                             f"{exc}") from None
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutputs) -> CompiledGrammar:
        """The compiled grammar for spec (cached, LRU); ValueError naming what is wrong with it. Thread-safe."""
        if not isinstance(spec, StructuredOutputs):
            raise TypeError(f"compile takes a StructuredOutputs, got {type(spec).__name__}")
        key = spec.cache_key()
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                return cached
        # compiled outside the lock: a large schema (llguidance releases the GIL) holds no other request back
        compiled = CompiledGrammar(spec, self._template(spec))
        with self._lock:
            compiled = self._cache.setdefault(key, compiled)  # another thread's compile of the same key may have won
            self._cache.move_to_end(key)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _template(self, spec: StructuredOutputs) -> llguidance.LLMatcher:
        """A matcher at the start of spec's grammar; ValueError with llguidance's reason if it does not compile."""
        matcher = llguidance.LLMatcher(self._tokenizer, grammar_text(spec), log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured_outputs.{spec.kind} cannot be used: "
                             f"{matcher.get_error()[:MAX_ERROR_CHARS]}")
        return matcher


def grammar_text(spec: StructuredOutputs) -> str:
    """spec as an llguidance grammar (not yet checked: building a matcher from it reports its faults)."""
    kind = spec.kind
    if kind == "json":
        return _json_grammar(_schema(json.loads(spec.value), spec), spec)
    if kind == "json_object":
        return _json_grammar({"type": "object"}, spec)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.value)
    if kind == "choice":
        alternatives = " | ".join(json.dumps(choice) for choice in json.loads(spec.value))
        return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
    if kind == "grammar":
        return llguidance.LLMatcher.grammar_from_lark(_lark(spec.value))
    if kind == "structural_tag":
        return _either_structural_tag(json.loads(spec.value), spec)
    raise ValueError(f"unknown structured output kind {kind!r}")


def _json_grammar(schema: dict, spec: StructuredOutputs) -> str:
    """An llguidance grammar for schema under spec's JSON options."""
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_json_options(spec))
    except ValueError as exc:  # the schema's own x-guidance options, read here, can be malformed
        raise ValueError(f"structured_outputs.{spec.kind} cannot be used: {exc}") from None


def _json_options(spec: StructuredOutputs) -> dict[str, Any]:
    """llguidance's JSON options for spec: compact or any whitespace, or the client's own whitespace pattern."""
    options: dict[str, Any] = {"whitespace_flexible": not spec.disable_any_whitespace}
    if spec.whitespace_pattern is not None:  # llguidance lets the pattern decide over whitespace_flexible
        options["whitespace_pattern"] = spec.whitespace_pattern
    return options


def _schema(schema: Any, spec: StructuredOutputs) -> dict:
    """The schema to compile: an object (llguidance puts its options in it), with every object closed to unlisted
    properties if the client asked for it."""
    if schema is True:
        return {}  # any JSON value
    if schema is False:
        raise ValueError(f"structured_outputs.{spec.kind}: the schema false allows no output at all")
    return close_objects(schema) if spec.disable_additional_properties else schema


def close_objects(schema: Any) -> Any:
    """A copy of schema in which each object schema listing properties and saying nothing of additionalProperties
    gets additionalProperties: false, at every depth."""
    if isinstance(schema, list):
        return [close_objects(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = dict(schema)
    for keyword in _SCHEMA_MAPS:
        if isinstance(schema.get(keyword), dict):
            closed[keyword] = {name: close_objects(sub) for name, sub in schema[keyword].items()}
    for keyword in _SUBSCHEMAS:
        if isinstance(schema.get(keyword), (dict, list)):
            closed[keyword] = close_objects(schema[keyword])
    lists_properties = isinstance(schema.get("properties"), dict) or isinstance(schema.get("patternProperties"), dict)
    if lists_properties and "additionalProperties" not in schema:
        closed["additionalProperties"] = False
    return closed


def _lark(text: str, name: str = "structured_outputs.grammar") -> str:
    """A grammar as Lark: GBNF (rules written "name ::= ...") converted, Lark as is; name: the field, for errors."""
    if not _GBNF_RULE.search(text):
        return text
    try:
        return gbnf_to_lark(text)
    except Exception as exc:  # noqa: BLE001 - the converter raises assorted types, each a fault of the grammar
        raise ValueError(f"{name} is not valid GBNF: {exc}") from None


def _either_structural_tag(tag: dict, spec: StructuredOutputs) -> str:
    """A structural tag in either form: the newer one with a format, or the older one with triggers and structures."""
    if "format" not in tag:
        return _structural_tag_grammar(tag, spec)
    return structural_tag_grammar(tag, Leaves(schema=lambda schema: _tag_schema(schema, spec), lark=_lark))


def _structural_tag_grammar(tag: dict, spec: StructuredOutputs) -> str:
    """Free text in which each trigger opens a segment: its begin, a JSON value following its schema, its end."""
    triggers, structures = tag.get("triggers"), tag.get("structures")
    if not (isinstance(triggers, list) and triggers and all(isinstance(t, str) and t for t in triggers)
            and isinstance(structures, list) and structures):
        raise ValueError("structured_outputs.structural_tag is not supported by this server in this form: give "
                         f"non-empty triggers and structures, as {_STRUCTURAL_TAG_FORM}, or a format, as "
                         f"{_STRUCTURAL_TAG_FORMAT_FORM}")
    return llguidance.StructTag.to_grammar([_struct_tag(item, triggers, spec) for item in structures])


def _struct_tag(item: Any, triggers: list[str], spec: StructuredOutputs) -> llguidance.StructTag:
    """One structure of a structural tag, checked (llguidance checks with assert only)."""
    if not (isinstance(item, dict) and isinstance(item.get("begin"), str) and isinstance(item.get("end"), str)
            and isinstance(item.get("schema"), dict)):
        raise ValueError(  # noqa: TRY004 - a client's input: callers answer ValueError with a 400
            "structured_outputs.structural_tag: each structure needs begin and end strings and a schema object, "
            f"got {json.dumps(item)[:200]}")
    begin = item["begin"]
    trigger = next((t for t in triggers if begin.startswith(t)), None)
    if trigger is None:
        raise ValueError(f"structured_outputs.structural_tag: begin {begin!r} starts with none of the triggers "
                         f"{triggers}")
    return llguidance.StructTag(trigger=trigger, begin=begin, grammar=_tag_schema(item["schema"], spec),
                                end=item["end"])


def _tag_schema(schema: dict | bool, spec: StructuredOutputs) -> dict:
    """A schema to compile inside a tag grammar: the JSON options travel in the schema itself, and options the
    schema sets for itself win, as they do for a json constraint."""
    schema = _schema(schema, spec)
    own = schema.get("x-guidance") if isinstance(schema.get("x-guidance"), dict) else {}
    return {**schema, "x-guidance": {**_json_options(spec), **own}}


class TokenMasker:
    """Fills many rows' next-token bitmasks in one batched call."""

    def __init__(self, vocab_size: int, threads: int = 2, pinned: bool = False) -> None:
        """vocab_size: the logits' width (the GrammarCompiler's); threads: llguidance's workers for the fill;
        pinned: the bitmask lives in page-locked memory, so its copy to a GPU need not wait for the work queued
        before it (the caller must not fill again before that copy has run)."""
        if vocab_size < 1 or threads < 1:
            raise ValueError(f"vocab_size and threads must be positive, got {vocab_size} and {threads}")
        self.vocab_size = vocab_size
        self.words = (vocab_size + BITS - 1) // BITS
        self.pinned = pinned
        self._executor = llguidance.LLExecutor(num_threads=threads)
        self._buffer = _allocate_bitmask(1, self.words, pinned)

    def fill(self, matchers: list[GrammarMatcher | None]) -> torch.Tensor:
        """int32 (len(matchers), ceil(vocab_size / 32)) on the CPU: bit t of row i set = row i may take token t.

        Rows without a matcher, or whose matcher is stopped or errored, allow every token; a matcher may fill one
        row only. The result is a view of a buffer the next call rewrites: use it (apply_token_bitmask, and let its
        copy finish) before calling again."""
        rows = len(matchers)
        if rows > self._buffer.shape[0]:  # grown, never shrunk: a batch's size varies step to step
            self._buffer = _allocate_bitmask(max(rows, 2 * self._buffer.shape[0]), self.words, self.pinned)
        bitmask = self._buffer[:rows]
        bitmask.fill_(-1)
        constrained = [(m.ll_matcher, row) for row, m in enumerate(matchers)
                       if m is not None and not m.ll_matcher.is_stopped()]
        if constrained:
            # what llguidance.torch.fill_next_token_bitmask_par does; that module is not imported because importing
            # it loads torch's compiler (seconds)
            self._executor.unsafe_compute_mask_ptr(constrained, bitmask.data_ptr(), self.words * 4, rows)
        return bitmask


    def fill_drafted(self, matchers: list[GrammarMatcher | None], drafts: list[list[int]]) -> torch.Tensor:
        """Like fill, for rows that carry drafts: row r's masks at its own next token and after each of its drafts,
        rows one after another (1 + len(drafts[r]) each). A matcher is advanced through its row's drafts while the
        grammar allows them (one batched fill per depth), then rolled back to where it was; the positions after a
        draft the grammar refuses, or after it stops, allow every token (the draft is rejected before them)."""
        counts = [1 + len(d) for d in drafts]
        rows = sum(counts)
        if rows > self._buffer.shape[0]:
            self._buffer = _allocate_bitmask(max(rows, 2 * self._buffer.shape[0]), self.words, self.pinned)
        bitmask = self._buffer[:rows]
        bitmask.fill_(-1)
        words = bitmask.numpy()
        starts = np.cumsum([0] + counts[:-1])
        live = [r for r, m in enumerate(matchers) if m is not None and not m.ll_matcher.is_stopped()]
        advanced = [0] * len(matchers)
        for depth in range(max(counts, default=0)):
            if not live:
                break
            pairs = [(matchers[r].ll_matcher, int(starts[r]) + depth) for r in live]
            self._executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), self.words * 4, rows)
            going = []
            for r in live:
                if depth == len(drafts[r]):
                    continue
                token = drafts[r][depth]
                row = int(starts[r]) + depth
                allowed = 0 <= token < self.vocab_size and (int(words[row, token // BITS]) >> (token % BITS)) & 1
                if allowed and matchers[r].accept(token):
                    advanced[r] += 1
                    if not matchers[r].ll_matcher.is_stopped():
                        going.append(r)
            live = going
        for r, n in enumerate(advanced):
            if n:
                matchers[r].rollback(n)
        return bitmask


def _allocate_bitmask(rows: int, words: int, pinned: bool) -> torch.Tensor:
    """An all-allowed bitmask in host memory, page-locked if asked (then its copy to a GPU is asynchronous)."""
    return torch.full((rows, words), -1, dtype=torch.int32, pin_memory=pinned)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits[i, t] = -inf wherever bit t of bitmask row i is 0, in place; logits (rows, V) of any float dtype on any
    device, bitmask the CPU int32 tensor from TokenMasker.fill with at least `rows` rows and V bits per row."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be (rows, vocab), got shape {tuple(logits.shape)}")
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2:
        raise ValueError(f"bitmask must be a 2-D int32 tensor, got {bitmask.dtype} of shape {tuple(bitmask.shape)}")
    rows, vocab = logits.shape
    words = (vocab + BITS - 1) // BITS
    if bitmask.shape[0] < rows or bitmask.shape[1] < words:
        raise ValueError(f"bitmask {tuple(bitmask.shape)} is too small for logits {tuple(logits.shape)}: it needs "
                         f"at least ({rows}, {words})")
    mask = bitmask[:rows]  # whole rows: a pinned buffer's view stays contiguous, so its copy stays asynchronous
    if mask.device != logits.device:
        mask = mask.to(logits.device, non_blocking=mask.is_pinned())
    shifts = torch.arange(BITS, dtype=torch.int32, device=logits.device)
    allowed = ((mask[:, :words].unsqueeze(-1) >> shifts) & 1).reshape(rows, words * BITS)[:, :vocab]
    logits.masked_fill_(allowed == 0, float("-inf"))
