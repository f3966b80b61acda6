"""The structural tag's newer form, {"type": "structural_tag", "format": {...}}, as an llguidance grammar.

The format is a tree of xgrammar's structural-tag format objects (the form vLLM >= 0.10 passes on): const_string,
json_schema, grammar, regex, any_text, sequence, or, tag, triggered_tags and tags_with_separator, with xgrammar's
field names and meanings. Each is checked (ValueError naming the field for anything malformed or unsupported) and
written as Lark for llguidance.

Free text (any_text, and the text between triggered_tags' tags) stops at the nearest enclosing tag's end, as in
xgrammar: it becomes one lazy lexeme ending at the first end string. So free text must come last in a tag's content
(the tag's end strings non-empty) or last in the whole output; anywhere else nothing says where it stops, and the
format is refused.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import llguidance

MAX_DEPTH = 64  # format objects nested deeper than this are refused (a guard on the recursion, not a real limit)
MAX_ERROR_CHARS = 1000
# the types this server translates, each with its required and optional fields (besides "type")
FIELDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "const_string": (("value",), ()),
    "json_schema": (("json_schema",), ("style", "any_order", "max_whitespace_cnt")),
    "grammar": (("grammar",), ()),
    "regex": (("pattern",), ()),
    "any_text": ((), ("excludes", "max_tokens", "max_chars")),
    "sequence": (("elements",), ()),
    "or": (("elements",), ()),
    "tag": (("begin", "content", "end"), ()),
    "triggered_tags": (("triggers", "tags"), ("at_least_one", "stop_after_first", "excludes")),
    "tags_with_separator": (("tags", "separator"), ("at_least_one", "stop_after_first")),
}
# optional fields accepted only at their default: the feature behind them is not implemented here
DEFAULT_ONLY: dict[tuple[str, str], Any] = {
    ("json_schema", "style"): "json", ("json_schema", "any_order"): False,
    ("json_schema", "max_whitespace_cnt"): None, ("any_text", "max_tokens"): None, ("any_text", "max_chars"): None,
}
# xgrammar's other format types, which this server does not translate
UNSUPPORTED = ("optional", "plus", "star", "repeat", "dispatch", "qwen_xml_parameter", "token", "exclude_token",
               "any_tokens", "token_triggered_tags", "token_dispatch")
TEXT = "/(?s:.*)/"  # any text, as a Lark regex
Ends = tuple[str, ...] | None  # what follows a format: one of these strings; () something else; None the output's end


@dataclass(frozen=True, slots=True)
class Leaves:
    """How leaf texts become grammar: a JSON schema (object or true) as the object to inline, a grammar as Lark."""

    schema: Callable[[dict | bool], dict]
    lark: Callable[[str, str], str]  # (grammar text, the field's name for errors) -> Lark text


def structural_tag_grammar(tag: dict, leaves: Leaves, name: str = "structured_outputs.structural_tag") -> str:
    """tag ({"type": "structural_tag", "format": {...}}) as an llguidance grammar (JSON text); ValueError naming the
    field for anything malformed or unsupported."""
    unknown = sorted(set(tag) - {"type", "format"})
    if unknown:
        raise ValueError(f"{name}: unknown field {unknown[0]}; give {{\"type\": \"structural_tag\", \"format\": "
                         "{...}}, or the older triggers and structures without format")
    if tag.get("type", "structural_tag") != "structural_tag":
        raise ValueError(f"{name}.type must be \"structural_tag\", got {tag['type']!r:.80}")
    if "format" not in tag:
        raise ValueError(f"{name}: missing field format (the format object, e.g. "
                         "{\"type\": \"const_string\", \"value\": \"...\"})")
    return _Translator(leaves).grammar(tag["format"], f"{name}.format")


class _Translator:
    """Writes one format tree as Lark rules, terminals and side grammars."""

    def __init__(self, leaves: Leaves) -> None:
        self.leaves = leaves
        self.lines: list[str] = []  # rules and terminals, after the start rule
        self.side_grammars: list[dict[str, str]] = []  # the grammar leaves, referenced as @name
        self.text_terminals: dict[tuple[str, ...], str] = {}  # excluded strings -> the free-text terminal's name
        self.written: dict[str, str] = {}  # [format, ends] as JSON -> its expression
        self.depth = 0

    def grammar(self, fmt: Any, path: str) -> str:
        """The whole output: fmt, then nothing."""
        start = f"start: {self.expr(fmt, path, None)}"
        main = {"name": "structural_tag", "lark_grammar": "\n".join([start, *self.lines]) + "\n"}
        return json.dumps({"grammars": [main, *self.side_grammars]})

    def expr(self, fmt: Any, path: str, ends: Ends) -> str:
        """A Lark expression for fmt followed by one of ends (nothing for () or None)."""
        kind = _checked_type(fmt, path)
        if self.depth >= MAX_DEPTH:
            raise ValueError(f"{path}: format objects are nested more than {MAX_DEPTH} deep")
        key = json.dumps([fmt, ends])  # a format met again (e.g. at_least_one's first tag) is written once
        if key in self.written:
            return self.written[key]
        self.depth += 1
        try:
            self.written[key] = getattr(self, f"_{kind}")(fmt, path, ends)
        finally:
            self.depth -= 1
        return self.written[key]

    def _const_string(self, fmt: dict, path: str, ends: Ends) -> str:
        return f"{_literal(_string(fmt, 'value', path))} {_alternatives(ends)}"

    def _json_schema(self, fmt: dict, path: str, ends: Ends) -> str:
        schema = fmt["json_schema"]
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"{path}.json_schema must be a JSON schema (an object or a boolean), "
                             f"got {type(schema).__name__}")
        if schema is False:
            raise ValueError(f"{path}.json_schema is false, which allows no output at all")
        inline = self.leaves.schema(schema)
        _validate(_json_grammar(inline, path), f"{path}.json_schema")
        return f"{self._rule('%json ' + json.dumps(inline))} {_alternatives(ends)}"

    def _grammar(self, fmt: dict, path: str, ends: Ends) -> str:
        lark = self.leaves.lark(_string(fmt, "grammar", path, non_empty=True), f"{path}.grammar")
        _validate(llguidance.LLMatcher.grammar_from_lark(lark), f"{path}.grammar")
        name = f"grammar_{len(self.side_grammars)}"
        self.side_grammars.append({"name": name, "lark_grammar": lark})
        return f"@{name} {_alternatives(ends)}"

    def _regex(self, fmt: dict, path: str, ends: Ends) -> str:
        pattern = _string(fmt, "pattern", path, non_empty=True)
        _validate(llguidance.LLMatcher.grammar_from_regex(pattern), f"{path}.pattern")
        # \d and \w are ASCII, as in xgrammar's (JavaScript-like) regexes
        return f"/{llguidance.regex_to_lark(pattern, 'dw')}/ {_alternatives(ends)}"

    def _any_text(self, fmt: dict, path: str, ends: Ends) -> str:
        return self._free_text(self._text(_strings(fmt, "excludes", path, non_empty=True)), "any_text", path, ends)

    def _sequence(self, fmt: dict, path: str, ends: Ends) -> str:
        elements = _formats(fmt, "elements", path)
        last = len(elements) - 1
        parts = [self.expr(element, f"{path}.elements[{i}]", ends if i == last else ())
                 for i, element in enumerate(elements)]
        return f"({' '.join(parts)})"

    def _or(self, fmt: dict, path: str, ends: Ends) -> str:
        elements = _formats(fmt, "elements", path)
        branches = [self.expr(element, f"{path}.elements[{i}]", ends) for i, element in enumerate(elements)]
        return f"({' | '.join(branches)})"

    def _tag(self, fmt: dict, path: str, ends: Ends) -> str:
        return f"{_literal(_string(fmt, 'begin', path))} {self._after_begin(fmt, path, ends)}"

    def _after_begin(self, fmt: dict, path: str, ends: Ends) -> str:
        """A tag's content and end, then one of ends. Free text in the content stops at the tag's end; a tag whose
        ends are all empty passes what follows it on to its content instead."""
        tag_ends = _tag_ends(fmt, path)
        if not any(tag_ends):
            return self.expr(fmt["content"], f"{path}.content", ends)
        return f"{self.expr(fmt['content'], f'{path}.content', tag_ends)} {_alternatives(ends)}"

    def _triggered_tags(self, fmt: dict, path: str, ends: Ends) -> str:
        """Free text in which each trigger starts one of its tags; at_least_one: a tag first, with no text before
        it; stop_after_first: nothing after the first tag."""
        groups = _trigger_groups(fmt, path)
        at_least_one, stop_after_first = _flag(fmt, "at_least_one", path), _flag(fmt, "stop_after_first", path)
        excludes = _strings(fmt, "excludes", path, non_empty=True)
        # at_least_one: the first tag, whole (no text before it)
        first = self._one_of(_tags(fmt, path)) if at_least_one else ""
        if at_least_one and stop_after_first:
            return f"{first} {_alternatives(ends)}"
        text = self._text(excludes)
        triggered = " | ".join(self._triggered(trigger, group, text) for trigger, group in groups.items())
        rest = self._free_text(text, "triggered_tags", path, ends)
        if stop_after_first:
            return f"({rest} | ({triggered}) {_alternatives(ends)})"
        return f"{first} ({triggered})* {rest}"

    def _triggered(self, trigger: str, group: list[tuple[dict, str]], text: str) -> str:
        """Free text up to the first trigger (one lazy lexeme), then the rest of one of its tags."""
        after = " | ".join(f"{_literal(tag['begin'][len(trigger):])} {self._after_begin(tag, tag_path, ())}"
                           for tag, tag_path in group)
        return f"{self._rule(f'{text} {_literal(trigger)}', lazy=True)} ({after})"

    def _tags_with_separator(self, fmt: dict, path: str, ends: Ends) -> str:
        """Tags and nothing else, the separator between them; at_least_one: not empty; stop_after_first: one."""
        one = self._one_of(_tags(fmt, path))
        separator = _string(fmt, "separator", path)
        body = one if _flag(fmt, "stop_after_first", path) else f"{one} ({_literal(separator)} {one})*"
        if not _flag(fmt, "at_least_one", path):
            body = f"({body})?"
        return f"{body} {_alternatives(ends)}"

    def _one_of(self, tags: list[tuple[dict, str]]) -> str:
        """Any one of tags (each followed by something else)."""
        return f"({' | '.join(self._tag(tag, tag_path, ()) for tag, tag_path in tags)})"

    def _free_text(self, text: str, kind: str, path: str, ends: Ends) -> str:
        """Free text (the terminal text) up to the output's end, or lazily up to the first of ends."""
        if ends is None:
            return text
        if not ends:
            raise ValueError(f"{path}: the free text of {kind} stops only at a tag's end or at the end of the output, "
                             "so it must come last in a tag's content or last in the whole output; here more follows")
        if not all(ends):
            raise ValueError(f"{path}: the free text of {kind} stops at the enclosing tag's end, so that tag's end "
                             f"strings must all be non-empty, got {json.dumps(list(ends))}")
        return self._rule(f"{text} {_alternatives(ends)}", lazy=True)

    def _text(self, excludes: list[str]) -> str:
        """The name of a terminal matching any text that contains none of excludes."""
        key = tuple(sorted(set(excludes)))
        if key not in self.text_terminals:
            body = TEXT if not key else f"{TEXT} & ~({TEXT} {_alternatives(key)} {TEXT})"
            self.text_terminals[key] = name = f"TEXT_{len(self.text_terminals)}"
            self.lines.append(f"{name}: {body}")
        return self.text_terminals[key]

    def _rule(self, body: str, lazy: bool = False) -> str:
        """A new rule with this body; lazy: its terminals form one lexeme that ends as early as it can."""
        name = f"r{len(self.lines)}"
        self.lines.append(f"{name}{'[lazy]' if lazy else ''}: {body}")
        return name


def _checked_type(fmt: Any, path: str, default: str | None = None) -> str:
    """fmt's type, once fmt is an object of a type this server translates, with its required fields and no others;
    default: the type when fmt names none."""
    if not isinstance(fmt, dict):
        raise ValueError(f"{path} must be a format object, got {type(fmt).__name__}")  # noqa: TRY004 - a client's input
    kind = fmt.get("type", default)
    if kind is None:
        raise ValueError(f"{path}: missing field type (one of {', '.join(FIELDS)})")
    if kind in UNSUPPORTED:
        raise ValueError(f"{path}.type {kind!r} is not supported by this server; use one of {', '.join(FIELDS)}")
    if kind not in FIELDS:
        raise ValueError(f"{path}.type must be one of {', '.join(FIELDS)}, got {kind!r:.80}")
    required, optional = FIELDS[kind]
    missing = [field for field in required if field not in fmt]
    if missing:
        raise ValueError(f"{path}: {kind} needs the field{'s' if len(missing) > 1 else ''} {', '.join(missing)}")
    unknown = sorted(set(fmt) - {"type", *required, *optional})
    if unknown:
        allowed = ", ".join((*required, *optional))
        raise ValueError(f"{path}: unknown field {unknown[0]} for {kind}; its fields: {allowed}")
    for field in optional:
        _default_only(fmt, kind, field, path)
    return kind


def _default_only(fmt: dict, kind: str, field: str, path: str) -> None:
    """ValueError if fmt sets field, one this server takes only at its default, to anything else."""
    if (kind, field) not in DEFAULT_ONLY:
        return
    default = DEFAULT_ONLY[kind, field]
    value = fmt.get(field, default)
    if value != default or type(value) is not type(default):
        raise ValueError(f"{path}.{field} is not supported by this server; leave it out or set it to "
                         f"{json.dumps(default)}")


def _string(fmt: dict, field: str, path: str, non_empty: bool = False) -> str:
    value = fmt.get(field)
    if not isinstance(value, str):
        raise ValueError(f"{path}.{field} must be a string, got {type(value).__name__}")  # noqa: TRY004 - as above
    if non_empty and not value:
        raise ValueError(f"{path}.{field} must not be empty")
    return value


def _flag(fmt: dict, field: str, path: str) -> bool:
    value = fmt.get(field, False)
    if not isinstance(value, bool):
        raise ValueError(f"{path}.{field} must be true or false, got {value!r:.80}")  # noqa: TRY004 - as above
    return value


def _strings(fmt: dict, field: str, path: str, non_empty: bool = False) -> list[str]:
    """An optional list of strings (empty when absent); non_empty: each string non-empty."""
    value = fmt.get(field, [])
    if not isinstance(value, list) or not all(isinstance(item, str) and (item or not non_empty) for item in value):
        what = "non-empty strings" if non_empty else "strings"
        raise ValueError(f"{path}.{field} must be a list of {what}, got {json.dumps(value)[:80]}")
    return value


def _formats(fmt: dict, field: str, path: str) -> list[Any]:
    value = fmt[field]
    if not isinstance(value, list) or not value:
        raise ValueError(f"{path}.{field} must be a non-empty list of format objects, got {json.dumps(value)[:80]}")
    return value


def _tags(fmt: dict, path: str) -> list[tuple[dict, str]]:
    """The tags field: a non-empty list of tag objects (their type may be left out), each with its path."""
    tags = [(tag, f"{path}.tags[{i}]") for i, tag in enumerate(_formats(fmt, "tags", path))]
    for tag, tag_path in tags:
        if _checked_type(tag, tag_path, default="tag") != "tag":
            raise ValueError(f"{tag_path}.type must be \"tag\" (or left out), got {tag['type']!r:.80}")
        _string(tag, "begin", tag_path)
    return tags


def _tag_ends(tag: dict, path: str) -> tuple[str, ...]:
    """A tag's end: a string or a non-empty list of strings, as a tuple."""
    end = tag["end"]
    if isinstance(end, str):
        return (end,)
    if isinstance(end, list) and end and all(isinstance(item, str) for item in end):
        return tuple(end)
    raise ValueError(f"{path}.end must be a string or a non-empty list of strings, got {json.dumps(end)[:80]}")


def _trigger_groups(fmt: dict, path: str) -> dict[str, list[tuple[dict, str]]]:
    """triggered_tags' tags grouped by their trigger: the one trigger each tag's begin starts with."""
    triggers = _strings(fmt, "triggers", path, non_empty=True)
    if not triggers:
        raise ValueError(f"{path}.triggers must be a non-empty list of non-empty strings")
    groups: dict[str, list[tuple[dict, str]]] = {trigger: [] for trigger in triggers}
    for tag, tag_path in _tags(fmt, path):
        matching = [trigger for trigger in groups if tag["begin"].startswith(trigger)]
        if len(matching) != 1:
            which = "none" if not matching else f"several ({', '.join(map(repr, matching))})"
            raise ValueError(f"{tag_path}.begin {tag['begin']!r:.80} must start with exactly one of the triggers "
                             f"{triggers}; it starts with {which}")
        groups[matching[0]].append((tag, tag_path))
    return {trigger: group for trigger, group in groups.items() if group}


def _json_grammar(schema: dict, path: str) -> str:
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema)
    except ValueError as exc:  # the schema's own x-guidance options can be malformed
        raise ValueError(f"{path}.json_schema cannot be used: {exc}") from None


def _validate(grammar: str, name: str) -> None:
    """ValueError naming the field if llguidance refuses grammar (one leaf of the format)."""
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise ValueError(f"{name} cannot be used: {messages[0][:MAX_ERROR_CHARS]}")


def _literal(text: str) -> str:
    """text as a Lark string literal (JSON escapes, which llguidance reads)."""
    return json.dumps(text)


def _alternatives(strings: Ends) -> str:
    """One of strings, as Lark; nothing for None, () or only empty strings."""
    if not strings or not any(strings):
        return ""
    return f"({' | '.join(_literal(text) for text in strings)})"
