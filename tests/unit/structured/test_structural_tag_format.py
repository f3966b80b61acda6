"""structural_tag in its newer form, {"type": "structural_tag", "format": {...}}, compiled by GrammarCompiler for
SmolLM2's tokenizer and the byte-level one: each format type accepts the texts that fit it in full and refuses the
others (the cases of xgrammar's own tests where they apply), and malformed or unsupported formats are ValueErrors
naming the field."""
from __future__ import annotations

import json

import jsonschema
import pytest

from backend.structured.spec import StructuredOutputs, parse_structured_outputs
from tests.unit.structured.test_grammar import (  # noqa: F401 - byte_vocab and vocab are the fixtures used here
    TOOL_SCHEMA,
    Vocab,
    byte_vocab,
    feed,
    random_walk,
    refuses,
    vocab,
)

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
           "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"], "additionalProperties": False}
NUMBER = {"type": "json_schema", "json_schema": {"type": "number"}}


def tag_spec(fmt: dict, **options) -> StructuredOutputs:
    return parse_structured_outputs({"structural_tag": {"type": "structural_tag", "format": fmt}, **options})


def accepts(vocab: Vocab, fmt: dict, text: str, **options) -> bool:
    """text is taken token by token and is complete; False if any token is refused or the text is unfinished."""
    matcher = vocab.compiler.compile(tag_spec(fmt, **options)).matcher()
    return all(matcher.accept(token) for token in vocab.encode(text)) and matcher.is_accepting


def tag(begin: str, content: dict, end: str | list[str]) -> dict:
    return {"type": "tag", "begin": begin, "content": content, "end": end}


def const(value: str) -> dict:
    return {"type": "const_string", "value": value}


def schema(json_schema: dict | bool) -> dict:
    return {"type": "json_schema", "json_schema": json_schema}


def tool_calls(**flags) -> dict:
    return {"type": "triggered_tags", "triggers": ["<function="],
            "tags": [tag("<function=get_weather>", schema(WEATHER), "</function>"),
                     tag("<function=get_time>", schema(TIME), "</function>")], **flags}


def test_const_string(vocab):
    fmt = const("Let's think step by step.")
    assert accepts(vocab, fmt, "Let's think step by step.")
    assert not accepts(vocab, fmt, "Let's think")  # a prefix is not complete
    assert refuses(vocab, tag_spec(fmt), "Let's think step by step!")
    assert refuses(vocab, tag_spec(fmt), "Let's think step by step..")


def test_json_schema(vocab):
    assert accepts(vocab, schema(WEATHER), '{"city": "Paris"}')
    assert refuses(vocab, tag_spec(schema(WEATHER)), '{"city": 3}')
    assert refuses(vocab, tag_spec(schema(WEATHER)), '{"town": "Paris"}')
    assert accepts(vocab, schema(True), '[1, {"a": null}]')


def test_json_schema_takes_the_json_options(byte_vocab):
    open_schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert accepts(byte_vocab, schema(open_schema), '{ "a": 1, "b": 2}')
    assert refuses(byte_vocab, tag_spec(schema(open_schema), disable_any_whitespace=True), '{ "a"')
    assert refuses(byte_vocab, tag_spec(schema(open_schema), disable_additional_properties=True), '{"a": 1, "b"')


@pytest.mark.parametrize("grammar", ['root ::= [-+]? [1-9] [0-9]*', 'start: /[-+]?[1-9][0-9]*/'],
                         ids=["gbnf", "lark"])
def test_grammar_in_a_tag(vocab, grammar):
    fmt = tag("BEG", {"type": "grammar", "grammar": grammar}, "END")
    assert accepts(vocab, fmt, "BEG12345END") and accepts(vocab, fmt, "BEG-7END")
    assert refuses(vocab, tag_spec(fmt), "BEG???END")
    assert refuses(vocab, tag_spec(fmt), "BEG12345ENDEND")


def test_regex(vocab):
    fmt = tag("BEG", {"type": "regex", "pattern": r"[+\-]?[1-9]\d*/\d{2}"}, "END")  # a slash, and \d
    assert accepts(vocab, fmt, "BEG12/34END")
    assert refuses(vocab, tag_spec(fmt), "BEG12-34END")
    assert refuses(vocab, tag_spec(fmt), "BEG١٢/34END")  # \d is ASCII, as in xgrammar


def test_any_text_alone_takes_anything(vocab):
    for text in ("ABCDEF", "any\ntext <b>at all</b>", ""):
        assert accepts(vocab, {"type": "any_text"}, text)


def test_any_text_in_a_tag_stops_at_the_first_end(vocab):
    fmt = tag("BEG", {"type": "any_text"}, "END")
    assert accepts(vocab, fmt, "BEGHello!END") and accepts(vocab, fmt, "BEGENENNDENEND")
    assert not accepts(vocab, fmt, "BEGENENDEN")
    assert refuses(vocab, tag_spec(fmt), "BEGBEGENDEND")


def test_any_text_excludes_and_several_ends(vocab):
    think = tag("<think>", {"type": "any_text", "excludes": ["</think>", "BAD"]}, "</think>")
    assert accepts(vocab, think, "<think>fine</think>") and accepts(vocab, think, "<think></think>")
    assert refuses(vocab, tag_spec(think), "<think>so BAD</think>")
    either = tag("<r>", {"type": "any_text"}, ["</r>", "</answer>"])
    assert accepts(vocab, either, "<r>x</r>") and accepts(vocab, either, "<r>x</answer>")
    assert refuses(vocab, tag_spec(either), "<r>x</r></answer>")


def test_sequence(vocab):
    fmt = {"type": "sequence", "elements": [const("Answer: "), schema(WEATHER)]}
    assert accepts(vocab, fmt, 'Answer: {"city": "Oslo"}')
    assert not accepts(vocab, fmt, "Answer: ")
    assert refuses(vocab, tag_spec(fmt), '{"city": "Oslo"}Answer: ')
    assert refuses(vocab, tag_spec(fmt), "Answer: Answer: ")


def test_or(vocab):
    fmt = {"type": "or", "elements": [const("Hello!"), NUMBER]}
    assert accepts(vocab, fmt, "Hello!") and accepts(vocab, fmt, "123")
    for text in ("Hello!Hello!", "123Hello!", "???"):
        assert refuses(vocab, tag_spec(fmt), text)


def test_tag(vocab):
    fmt = tag("<response>", schema(WEATHER), ["</response>", "</answer>"])
    assert accepts(vocab, fmt, '<response>{"city": "Lima"}</response>')
    assert accepts(vocab, fmt, '<response>{"city": "Lima"}</answer>')
    assert refuses(vocab, tag_spec(fmt), '<answer>{"city": "Lima"}</answer>')
    assert refuses(vocab, tag_spec(fmt), '<response>{"city": "Lima"}</reply>')


def test_triggered_tool_calls_in_free_text(vocab):
    fmt = tool_calls()
    assert accepts(vocab, fmt, 'Let me look. <function=get_weather>{"city": "Paris"}</function> Done.')
    assert accepts(vocab, fmt, '<function=get_time>{"zone": "UTC"}</function><function=get_weather>'
                               '{"city": "Paris"}</function> and text after')
    assert accepts(vocab, fmt, "No tool call at all.")
    assert refuses(vocab, tag_spec(fmt), 'Now <function=get_wether>{"city": "Paris"}</function>')  # unknown name
    assert refuses(vocab, tag_spec(fmt), '<function=get_weather>{"city": 7}</function>')  # against the schema
    assert refuses(vocab, tag_spec(fmt), '<function=get_weather>{"zone": "UTC"}</function>')
    assert refuses(vocab, tag_spec(fmt), '<function=get_weather>{"city": "Paris"}</func>')


def triggered(at_least_one: bool, stop_after_first: bool) -> dict:
    """xgrammar's own test case: trigger "A", tags A1 L1 A and A2 L2 A."""
    return {"type": "triggered_tags", "triggers": ["A"], "tags": [tag("A1", const("L1"), "A"), tag("A2", const("L2"), "A")],
            "at_least_one": at_least_one, "stop_after_first": stop_after_first}


FLAGS = [(False, False), (True, False), (False, True), (True, True)]  # (at_least_one, stop_after_first)


@pytest.mark.parametrize("text, accepted", [  # for each of FLAGS, as xgrammar answers
    ("textA1L1AtextA2L2AText", [True, False, False, False]),
    ("A1L1Atext", [True, True, False, False]),
    ("A1L1AtextA2L2A", [True, True, False, False]),
    ("A1L1A", [True, True, True, True]),
    ("xA1L1A", [True, False, True, False]),
    ("text", [True, False, True, False]),
    ("", [True, False, True, False]),
    ("AA", [False, False, False, False]),
    ("A1L2A", [False, False, False, False]),
    ("A1L1A2L2A", [False, False, False, False]),
])
def test_triggered_tags_flags(byte_vocab, text, accepted):
    assert [accepts(byte_vocab, triggered(*flags), text) for flags in FLAGS] == accepted


@pytest.mark.parametrize("text, accepted", [
    ("beginabcA1L1Atextend", [True, False, False, False]),
    ("beginA1L1AtextA2L2Aend", [True, True, False, False]),
    ("beginA1L1Aend", [True, True, True, True]),
    ("beginend", [True, False, True, False]),
    ("beginA1L1Aendabc", [False, False, False, False]),
    ("beginA1L2end", [False, False, False, False]),
])
def test_triggered_tags_in_a_tag_stop_at_its_end(byte_vocab, text, accepted):
    assert [accepts(byte_vocab, tag("begin", triggered(*flags), "end"), text) for flags in FLAGS] == accepted


def test_triggered_tags_with_smollm2_flags(vocab):
    call = '<function=get_weather>{"city": "Paris"}</function>'
    assert accepts(vocab, tool_calls(at_least_one=True), call + " then text")
    assert refuses(vocab, tag_spec(tool_calls(at_least_one=True)), "Text first " + call)
    assert accepts(vocab, tool_calls(stop_after_first=True), "Text first " + call)
    assert refuses(vocab, tag_spec(tool_calls(stop_after_first=True)), call + " then text")
    assert accepts(vocab, tool_calls(at_least_one=True, stop_after_first=True), call)
    assert not accepts(vocab, tool_calls(at_least_one=True, stop_after_first=True), "")


def test_triggered_tags_excludes(vocab):
    fmt = {**tool_calls(), "excludes": ["<tool_call>"]}
    assert accepts(vocab, fmt, "plain text")
    assert refuses(vocab, tag_spec(fmt), "plain <tool_call> text")


@pytest.mark.parametrize("text, accepted", [  # for each of FLAGS, as xgrammar answers
    ("", [True, False, True, False]),
    ("A1L1A", [True, True, True, True]),
    ("A1L1AAAA2L2A", [True, True, False, False]),
    ("A1L1AAAA2L2AAAA1L1A", [True, True, False, False]),
    ("A1L1AA2L2A", [False, False, False, False]),  # a wrong separator
    ("A1L1AAA", [False, False, False, False]),  # a separator with no tag after it
    ("text", [False, False, False, False]),
])
def test_tags_with_separator(byte_vocab, text, accepted):
    def fmt(at_least_one, stop_after_first):
        return {"type": "tags_with_separator", "tags": [tag("A1", const("L1"), "A"), tag("A2", const("L2"), "A")],
                "separator": "AA", "at_least_one": at_least_one, "stop_after_first": stop_after_first}

    assert [accepts(byte_vocab, fmt(*flags), text) for flags in FLAGS] == accepted


def test_tags_with_separator_as_tool_calls(vocab):
    fmt = {"type": "tags_with_separator", "separator": "\n", "at_least_one": True,
           "tags": [{"begin": "<tool>", "content": schema(WEATHER), "end": "</tool>"}]}  # a tag's type may be left out
    assert accepts(vocab, fmt, '<tool>{"city": "Paris"}</tool>\n<tool>{"city": "Lima"}</tool>')
    assert refuses(vocab, tag_spec(fmt), 'Sure: <tool>{"city": "Paris"}</tool>')


def test_reasoning_then_tool_calls(vocab):
    fmt = {"type": "sequence", "elements": [tag("<think>", {"type": "any_text"}, "</think>"), tool_calls()]}
    assert accepts(vocab, fmt, '<think>The user wants\nweather.</think>Calling. <function=get_weather>'
                               '{"city": "Paris"}</function>')
    assert accepts(vocab, fmt, "<think>hm</think>")
    assert refuses(vocab, tag_spec(fmt), "No thinking first")


def test_nested_tags_stop_at_the_nearest_end(vocab):
    fmt = {"type": "sequence", "elements": [tag("<a>", tag("<b>", {"type": "any_text"}, "</b>"), "</a>"), const("X")]}
    assert accepts(vocab, fmt, "<a><b>1</b></a>X")
    assert refuses(vocab, tag_spec(fmt), "<a><b>1</b>2</b></a>X")


def test_the_format_may_come_as_a_json_string(byte_vocab):
    text = json.dumps({"type": "structural_tag", "format": const("ok")})
    constraint = parse_structured_outputs(json.dumps({"structural_tag": text}))
    assert feed(byte_vocab, constraint, "ok").is_accepting


@pytest.mark.parametrize("seed", range(3))
def test_random_walks_through_forced_tool_calls_follow_the_schema(vocab, seed):
    fmt = {"type": "tags_with_separator", "separator": ",", "at_least_one": True, "stop_after_first": True,
           "tags": [tag("<tool>", schema(TOOL_SCHEMA), "</tool>")]}
    text = random_walk(vocab, tag_spec(fmt, disable_any_whitespace=True), seed)
    assert text.startswith("<tool>") and text.endswith("</tool>")
    jsonschema.validate(json.loads(text[len("<tool>"):-len("</tool>")]), TOOL_SCHEMA)


P = r"structured_outputs\.structural_tag"
F = P + r"\.format"


@pytest.mark.parametrize("structural_tag, message", [
    ({"type": "structural_tag", "format": "const_string"}, F + r" must be a format object, got str"),
    ({"type": "other", "format": const("x")}, P + r'\.type must be "structural_tag", got \'other\''),
    ({"format": const("x"), "structures": []}, P + r": unknown field structures; give .*format"),
    ({"format": {"type": "foo"}}, F + r"\.type must be one of const_string, json_schema, .*, got 'foo'"),
    ({"format": {"type": "star", "content": const("x")}}, F + r"\.type 'star' is not supported by this server"),
    ({"format": {"value": "x"}}, F + r": missing field type \(one of const_string, "),
    ({"format": {"type": "const_string"}}, F + r": const_string needs the field value"),
    ({"format": {"type": "tag", "begin": "<a>"}}, F + r": tag needs the fields content, end"),
    ({"format": {"type": "const_string", "value": 3}}, F + r"\.value must be a string, got int"),
    ({"format": {"type": "const_string", "value": "x", "valeu": "y"}},
     F + r": unknown field valeu for const_string; its fields: value"),
    ({"format": {"type": "sequence", "elements": [const("a"), tag("<", {"type": "regex"}, ">")]}},
     F + r"\.elements\[1\]\.content: regex needs the field pattern"),
    ({"format": {"type": "or", "elements": []}}, F + r"\.elements must be a non-empty list of format objects"),
    ({"format": {**tool_calls(), "triggers": []}}, F + r"\.triggers must be a non-empty list of non-empty strings"),
    ({"format": {**tool_calls(), "triggers": ["<tool="]}},
     F + r"\.tags\[0\]\.begin '<function=get_weather>' must start with exactly one of the triggers \['<tool='\]"),
    ({"format": {**tool_calls(), "triggers": ["<f", "<function="]}},
     F + r"\.tags\[0\]\.begin .* it starts with several"),
    ({"format": {**tool_calls(), "at_least_one": "yes"}}, F + r"\.at_least_one must be true or false, got 'yes'"),
    ({"format": {"type": "tags_with_separator", "tags": [const("x")], "separator": ","}},
     F + r'\.tags\[0\]\.type must be "tag" \(or left out\)'),
    ({"format": tag("<a>", const("x"), [])}, F + r"\.end must be a string or a non-empty list of strings"),
    ({"format": {"type": "sequence", "elements": [{"type": "any_text"}, const("END")]}},
     F + r"\.elements\[0\]: the free text of any_text .* must come last in a tag's content or last in the whole"),
    ({"format": {"type": "tags_with_separator", "separator": ",", "tags": [tag("<a>", {"type": "any_text"}, "")]}},
     F + r"\.tags\[0\]\.content: the free text of any_text .* must come last"),
    ({"format": tag("<a>", {"type": "any_text"}, ["</a>", ""])},
     F + r"\.content: .* that tag's end strings must all be non-empty"),
    ({"format": {"type": "sequence", "elements": [tool_calls(), const("bye")]}},
     F + r"\.elements\[0\]: the free text of triggered_tags"),
    ({"format": schema(False)}, F + r"\.json_schema is false, which allows no output at all"),
    ({"format": schema([1])}, F + r"\.json_schema must be a JSON schema \(an object or a boolean\), got list"),
    ({"format": {**schema(WEATHER), "style": "qwen_xml"}},
     F + r'\.style is not supported by this server; leave it out or set it to "json"'),
    ({"format": {"type": "any_text", "max_tokens": 10}}, F + r"\.max_tokens is not supported by this server"),
    ({"format": {"type": "any_text", "excludes": "</a>"}}, F + r"\.excludes must be a list of non-empty strings"),
    ({"format": schema({"type": "array", "uniqueItems": True})}, F + r"\.json_schema cannot be used: .*uniqueItems"),
    ({"format": {"type": "regex", "pattern": "(("}}, F + r"\.pattern cannot be used: (?s:.*)unclosed group"),
    ({"format": {"type": "grammar", "grammar": "start: missing_rule"}}, F + r"\.grammar cannot be used: .*missing_rule"),
    ({"format": {"type": "grammar", "grammar": 'root ::= "a" b'}}, F + r"\.grammar is not valid GBNF"),
])
def test_faults_name_the_field(byte_vocab, structural_tag, message):
    with pytest.raises(ValueError, match=message):
        byte_vocab.compiler.compile(parse_structured_outputs({"structural_tag": structural_tag}))


def test_formats_nested_too_deep(byte_vocab):
    fmt = const("x")
    for _ in range(70):
        fmt = {"type": "or", "elements": [fmt]}
    with pytest.raises(ValueError, match=F + r"(\.elements\[0\])+: format objects are nested more than 64 deep"):
        byte_vocab.compiler.compile(tag_spec(fmt))
