"""StructuredOutputs: one request's output constraint, read from the `structured_outputs` sampling parameter.

The wire format is the one OpenAI-compatible frontends send (vLLM's StructuredOutputsParams field names): an
object, or a JSON string holding one, with exactly one of json, regex, choice, grammar, json_object or
structural_tag set, and the options disable_any_whitespace, disable_additional_properties and whitespace_pattern.
Null means unset. Only the shape is checked here; whether a schema, regex or grammar compiles is decided by
backend/structured/grammar.py, which needs the tokenizer.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from backend.text_values import bool_word, parse_bool

CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
OPTIONS = ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern")
# sent by frontends that pick among grammar libraries; this server has one, so they carry nothing for it
IGNORED_FIELDS = ("backend", "_backend", "_backend_was_auto", "disable_fallback")
ALLOWED_FIELDS = CONSTRAINTS + OPTIONS + IGNORED_FIELDS


@dataclass(frozen=True, slots=True)
class StructuredOutputs:
    """One request's output constraint, parsed and checked."""

    kind: str  # one of CONSTRAINTS
    # canonical text: json / structural_tag -> compact JSON text (key order kept: it is the order properties are
    # generated in), regex -> the pattern, choice -> json.dumps(list of strings), grammar -> the grammar text,
    # json_object -> ""
    value: str
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def cache_key(self) -> str:
        """One string covering every field: equal keys compile to the same grammar."""
        return json.dumps([self.kind, self.value, self.disable_any_whitespace, self.disable_additional_properties,
                           self.whitespace_pattern], separators=(",", ":"))


def parse_structured_outputs(value: Any, key: str = "structured_outputs") -> StructuredOutputs | None:
    """What a client sent as `key` (an object, a JSON string holding one, or null) -> StructuredOutputs or None.

    ValueError naming `key` and the field for anything malformed: no constraint or more than one, an unknown field,
    a field of the wrong type, text that is not JSON."""
    if value is None or isinstance(value, StructuredOutputs):
        return value
    fields = _as_object(value, key)
    if fields is None:  # the JSON text "null"
        return None
    unknown = sorted(set(fields) - set(ALLOWED_FIELDS))
    if unknown:
        raise ValueError(f"{key}: unknown field{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
                         f"allowed: {', '.join(CONSTRAINTS + OPTIONS)}")
    kind = _one_constraint(fields, key)
    return StructuredOutputs(
        kind=kind,
        value=_CANONICAL[kind](fields[kind], f"{key}.{kind}"),
        disable_any_whitespace=_option_bool(fields, "disable_any_whitespace", key),
        disable_additional_properties=_option_bool(fields, "disable_additional_properties", key),
        whitespace_pattern=_whitespace_pattern(fields.get("whitespace_pattern"), key),
    )


def _as_object(value: Any, key: str) -> dict | None:
    """The fields as a dict: a dict as is, a string parsed as JSON (None for the text "null")."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ValueError(f"{key} must be a JSON object, and its text is not valid JSON: {exc}") from None
        if value is None:
            return None
    if not isinstance(value, dict):
        raise ValueError(  # noqa: TRY004 - a client's input: callers answer ValueError with a 400
            f"{key} must be an object with one of {', '.join(CONSTRAINTS)}, got {type(value).__name__}")
    return value


def _is_set(name: str, value: Any) -> bool:
    """Null leaves a field unset; so does json_object: false (the frontends send it for "no JSON object")."""
    if value is None:
        return False
    return name != "json_object" or bool_word(value) is not False


def _one_constraint(fields: dict, key: str) -> str:
    """The name of the one constraint set in fields; ValueError for none or several."""
    given = [name for name in CONSTRAINTS if _is_set(name, fields.get(name))]
    if not given:
        raise ValueError(f"{key}: give exactly one of {', '.join(CONSTRAINTS)}")
    if len(given) > 1:
        named = ", ".join(given[:-1]) + " and " + given[-1]
        raise ValueError(f"{key}: give exactly one of {', '.join(CONSTRAINTS)}, not {named} together")
    return given[0]


def _json_text(value: Any, name: str, what: str, types: tuple[type, ...]) -> str:
    """value (one of types, or a string holding JSON of one) as compact JSON text; ValueError naming `what`."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ValueError(f"{name} must be {what}, and its text is not valid JSON: {exc}") from None
    if not isinstance(value, types):
        raise ValueError(f"{name} must be {what}, got {type(value).__name__}")  # noqa: TRY004 - as above
    try:
        # keys keep their order: a schema's property order is the order the output writes them in
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name} must be {what}: {exc}") from None


_SCHEMA = "a JSON schema (an object or a boolean) or a string holding one"
_TAG = "a structural tag (an object) or a string holding one"


def _schema(value: Any, name: str) -> str:
    return _json_text(value, name, _SCHEMA, (dict, bool))


def _structural_tag(value: Any, name: str) -> str:
    return _json_text(value, name, _TAG, (dict,))


def _text(value: Any, name: str) -> str:
    """A regex or grammar: a non-empty string."""
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a string, got {type(value).__name__}")  # noqa: TRY004 - as above
    if not value.strip():
        raise ValueError(f"{name} must not be empty")
    return value


def _choice(value: Any, name: str) -> str:
    """A non-empty list of strings, as JSON text."""
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"{name} must be a non-empty list of strings, got {value!r:.80}")
    wrong = [item for item in value if not isinstance(item, str)]
    if wrong:
        raise ValueError(f"{name} must be a non-empty list of strings; {wrong[0]!r:.80} is not a string")
    return json.dumps(list(value), ensure_ascii=False)


def _json_object(value: Any, name: str) -> str:
    """json_object: true (false and null never get here); the constraint carries no text."""
    if bool_word(value) is not True:
        raise ValueError(f"{name} must be true, false or null, got {value!r:.80}")
    return ""


_CANONICAL = {"json": _schema, "regex": _text, "choice": _choice, "grammar": _text, "json_object": _json_object,
              "structural_tag": _structural_tag}


def _option_bool(fields: dict, name: str, key: str) -> bool:
    """A boolean option: true/false (or their words), null or absent for false."""
    value = fields.get(name)
    return False if value is None else parse_bool(f"{key}.{name}", value)


def _whitespace_pattern(value: Any, key: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{key}.whitespace_pattern must be a regex string or null, got {type(value).__name__}")
    return value
