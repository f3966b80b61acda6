"""parse_structured_outputs: every form a client sends, every malformed one refused with a message naming the fault."""
from __future__ import annotations

import dataclasses
import json

import pytest

from backend.structured.spec import StructuredOutputs, parse_structured_outputs

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name"]}
COMPACT_SCHEMA = ('{"type":"object","properties":{"name":{"type":"string"},"age":{"type":"integer"}},'
                  '"required":["name"]}')


def frontend_dump(**fields) -> str:
    """What an OpenAI-compatible frontend sends: every field present, the unset ones null."""
    body = {"json": None, "regex": None, "choice": None, "grammar": None, "json_object": None,
            "disable_fallback": False, "disable_any_whitespace": False, "disable_additional_properties": False,
            "whitespace_pattern": None, "structural_tag": None, "_backend": None, "_backend_was_auto": False}
    body.update(fields)
    return json.dumps(body)


def test_none_and_json_null_are_unset():
    assert parse_structured_outputs(None) is None
    assert parse_structured_outputs("null") is None


def test_schema_as_dict_and_as_string_give_the_same_spec():
    from_dict = parse_structured_outputs({"json": SCHEMA})
    from_string = parse_structured_outputs({"json": json.dumps(SCHEMA, indent=2)})
    from_text = parse_structured_outputs(json.dumps({"json": SCHEMA}))
    assert from_dict == from_string == from_text == StructuredOutputs("json", COMPACT_SCHEMA)


def test_schema_keeps_its_key_order():
    """Property order is the order the output writes keys in: two orders are two constraints."""
    forward = parse_structured_outputs({"json": {"properties": {"a": {}, "b": {}}}})
    backward = parse_structured_outputs({"json": {"properties": {"b": {}, "a": {}}}})
    assert forward.value == '{"properties":{"a":{},"b":{}}}'
    assert forward.cache_key() != backward.cache_key()


def test_boolean_schema():
    assert parse_structured_outputs({"json": True}) == StructuredOutputs("json", "true")
    assert parse_structured_outputs({"json": "true"}) == StructuredOutputs("json", "true")


def test_the_openai_frontend_dump():
    spec = parse_structured_outputs(frontend_dump(json=json.dumps(SCHEMA)))
    assert spec == StructuredOutputs("json", COMPACT_SCHEMA)
    with_backend = parse_structured_outputs(frontend_dump(regex="[a-z]+", backend="guidance", _backend="guidance",
                                                          _backend_was_auto=True, disable_fallback=True))
    assert with_backend == StructuredOutputs("regex", "[a-z]+")


def test_json_object():
    assert parse_structured_outputs({"json_object": True}) == StructuredOutputs("json_object", "")
    assert parse_structured_outputs(frontend_dump(json_object=True)).kind == "json_object"
    assert parse_structured_outputs({"json_object": "true"}).kind == "json_object"


def test_json_object_false_is_unset():
    assert parse_structured_outputs({"json_object": False, "regex": "x"}) == StructuredOutputs("regex", "x")


def test_choice_regex_grammar():
    assert parse_structured_outputs({"choice": ["yes", "no", "é \"q\""]}) == \
        StructuredOutputs("choice", json.dumps(["yes", "no", "é \"q\""], ensure_ascii=False))
    assert parse_structured_outputs({"regex": r"\d{3}"}) == StructuredOutputs("regex", r"\d{3}")
    grammar = 'root ::= "a" | "b"'
    assert parse_structured_outputs({"grammar": grammar}) == StructuredOutputs("grammar", grammar)


def test_structural_tag_as_string_and_dict():
    tag = {"type": "structural_tag", "triggers": ["<f"],
           "structures": [{"begin": "<f=x>", "schema": {"type": "object"}, "end": "</f>"}]}
    from_dict = parse_structured_outputs({"structural_tag": tag})
    assert from_dict == parse_structured_outputs({"structural_tag": json.dumps(tag)})
    assert from_dict.kind == "structural_tag" and json.loads(from_dict.value) == tag


def test_options():
    spec = parse_structured_outputs({"json": SCHEMA, "disable_any_whitespace": True,
                                     "disable_additional_properties": "true", "whitespace_pattern": "[ ]?"})
    assert spec == StructuredOutputs("json", COMPACT_SCHEMA, disable_any_whitespace=True,
                                     disable_additional_properties=True, whitespace_pattern="[ ]?")
    plain = parse_structured_outputs({"json": SCHEMA, "disable_any_whitespace": None, "whitespace_pattern": None})
    assert not plain.disable_any_whitespace and plain.whitespace_pattern is None


def test_a_parsed_spec_passes_through():
    spec = StructuredOutputs("regex", "a")
    assert parse_structured_outputs(spec) is spec


def test_spec_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        StructuredOutputs("regex", "a").kind = "json"


@pytest.mark.parametrize("value", [{}, frontend_dump(), {"disable_any_whitespace": True}, {"json_object": False}])
def test_no_constraint(value):
    with pytest.raises(ValueError, match=r"^structured_outputs: give exactly one of json, regex, choice, grammar, "
                                         r"json_object, structural_tag$"):
        parse_structured_outputs(value)


def test_two_constraints_are_named():
    with pytest.raises(ValueError, match=r"exactly one of .*, not json and regex together"):
        parse_structured_outputs({"json": SCHEMA, "regex": "a"})
    with pytest.raises(ValueError, match="not regex, choice and json_object together"):
        parse_structured_outputs({"regex": "a", "choice": ["a"], "json_object": True})


def test_unknown_field_is_named_with_the_allowed_ones():
    with pytest.raises(ValueError, match=r"structured_outputs: unknown field guided_json; allowed: json, regex, "
                                         r"choice, grammar, json_object, structural_tag, disable_any_whitespace"):
        parse_structured_outputs({"guided_json": SCHEMA})


def test_key_names_the_parameter():
    with pytest.raises(ValueError, match=r"^guided_decoding\.regex must be a string"):
        parse_structured_outputs({"regex": 5}, key="guided_decoding")


@pytest.mark.parametrize("fields, message", [
    ({"json": [1, 2]}, r"structured_outputs\.json must be a JSON schema \(an object or a boolean\).*got list"),
    ({"json": "{not json"}, r"structured_outputs\.json must be a JSON schema.*not valid JSON"),
    ({"json": "[1]"}, r"structured_outputs\.json must be a JSON schema.*got list"),
    ({"regex": 3}, r"structured_outputs\.regex must be a string, got int"),
    ({"regex": ""}, r"structured_outputs\.regex must not be empty"),
    ({"grammar": ["a"]}, r"structured_outputs\.grammar must be a string, got list"),
    ({"choice": []}, r"structured_outputs\.choice must be a non-empty list of strings"),
    ({"choice": "yes"}, r"structured_outputs\.choice must be a non-empty list of strings"),
    ({"choice": ["a", 1]}, r"structured_outputs\.choice must be a non-empty list of strings; 1 is not a string"),
    ({"json_object": "maybe"}, r"structured_outputs\.json_object must be true, false or null"),
    ({"structural_tag": True}, r"structured_outputs\.structural_tag must be a structural tag \(an object\)"),
    ({"regex": "a", "disable_any_whitespace": "sometimes"},
     r"structured_outputs\.disable_any_whitespace must be true or false"),
    ({"regex": "a", "disable_additional_properties": 2},
     r"structured_outputs\.disable_additional_properties must be true or false"),
    ({"regex": "a", "whitespace_pattern": 1}, r"structured_outputs\.whitespace_pattern must be a regex string or null"),
])
def test_wrong_types_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        parse_structured_outputs(fields)


@pytest.mark.parametrize("value, message", [
    ("{\"json\": ", r"^structured_outputs must be a JSON object, and its text is not valid JSON"),
    ("[1]", r"^structured_outputs must be an object with one of json, regex.*got list"),
    (42, r"^structured_outputs must be an object with one of .*got int"),
])
def test_not_an_object(value, message):
    with pytest.raises(ValueError, match=message):
        parse_structured_outputs(value)


def test_cache_key_covers_every_field():
    base = StructuredOutputs("json", COMPACT_SCHEMA)
    variants = [dataclasses.replace(base, kind="structural_tag"), dataclasses.replace(base, value='{"type":"object"}'),
                dataclasses.replace(base, disable_any_whitespace=True),
                dataclasses.replace(base, disable_additional_properties=True),
                dataclasses.replace(base, whitespace_pattern=" "), dataclasses.replace(base, whitespace_pattern="")]
    keys = [base.cache_key()] + [v.cache_key() for v in variants]
    assert len(set(keys)) == len(keys)
    assert StructuredOutputs("json", COMPACT_SCHEMA).cache_key() == base.cache_key()
