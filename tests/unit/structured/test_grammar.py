"""GrammarCompiler, GrammarMatcher, TokenMasker and apply_token_bitmask on SmolLM2's tokenizer and on the byte-level
tokenizer under a wider vocabulary: random walks through each constraint's masks end in valid outputs, EOS is allowed
only where the output is complete, faults are ValueErrors, the cache, rollback and the logits mask."""
from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass

import jsonschema
import pytest
import torch

from backend.models.random_model import EOS_ID, byte_tokenizer
from backend.structured.grammar import (
    CompiledGrammar,
    GrammarCompiler,
    GrammarMatcher,
    TokenMasker,
    apply_token_bitmask,
)
from backend.structured.spec import StructuredOutputs, parse_structured_outputs

BYTE_VOCAB = 1000  # wider than the byte tokenizer (257 tokens), as random-weight logits are; not a multiple of 32

TOOL_SCHEMA = {  # bounded, so a random walk through it ends: short strings, an integer range, a few items
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 10},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "urgent": {"type": "boolean"},
    },
    "required": ["city", "days", "unit"],
    "additionalProperties": False,
}
DATE_REGEX = r"[0-9]{4}-(0[1-9]|1[0-2])-[0-9]{2}( [a-z]{1,5})?"
CHOICES = ["red", "redder", "dark blue", "vert é", 'say "hi"']
LARK = 'start: VERB " " TARGET\nVERB: "open" | "close" | "move"\nTARGET: /[a-z]{1,8}/ | "door 42"\n'
LARK_LANGUAGE = r"(open|close|move) ([a-z]{1,8}|door 42)"
GBNF = 'root ::= greeting ", " name "!"\ngreeting ::= "hello" | "hi"\nname ::= [A-Z] [a-z]{1,5}\n'
GBNF_LANGUAGE = r"(hello|hi), [A-Z][a-z]{1,5}!"
EXPRESSION_GBNF = """root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= number | "(" expr ")"
number ::= [0-9]+
"""
SEEDS = range(4)


@dataclass
class Vocab:
    """A tokenizer, the logits' width, its EOS, and the compiler and masker made for them."""

    name: str
    tokenizer: object
    vocab_size: int
    eos: int
    compiler: GrammarCompiler
    masker: TokenMasker

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, clean_up_tokenization_spaces=False)


def smollm2_tokenizer():
    default_model = pytest.importorskip("backend.models.default_model")
    try:
        path = default_model.resolve_model_path(default_model.DEFAULT_ALIAS)
    except (RuntimeError, OSError, ValueError) as exc:  # the model package or its conversion is unavailable here
        pytest.skip(f"SmolLM2 unavailable: {exc}")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module", params=["smollm2", "byte"])
def vocab(request) -> Vocab:
    if request.param == "smollm2":
        tokenizer = smollm2_tokenizer()
        size, eos = 49152, tokenizer.eos_token_id
    else:
        tokenizer, size, eos = byte_tokenizer(), BYTE_VOCAB, EOS_ID
    return Vocab(request.param, tokenizer, size, eos, GrammarCompiler(tokenizer, size, eos), TokenMasker(size))


@pytest.fixture(scope="module")
def byte_vocab() -> Vocab:
    tokenizer = byte_tokenizer()
    return Vocab("byte", tokenizer, BYTE_VOCAB, EOS_ID, GrammarCompiler(tokenizer, BYTE_VOCAB, EOS_ID),
                 TokenMasker(BYTE_VOCAB))


def spec(**fields) -> StructuredOutputs:
    return parse_structured_outputs(fields)


def allowed(bitmask_row: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """A bitmask row as one bool per token (a loop-free reading, checked against the loop in test_apply_*)."""
    bits = (bitmask_row.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.reshape(-1)[:vocab_size].bool()


def eos_allowed(vocab: Vocab, matcher: GrammarMatcher) -> bool:
    return bool(allowed(vocab.masker.fill([matcher])[0], vocab.vocab_size)[vocab.eos])


def random_walk(vocab: Vocab, constraint: StructuredOutputs, seed: int, max_steps: int = 300) -> str:
    """Sample uniformly among the allowed tokens until EOS is drawn or the grammar stops; the text generated."""
    matcher = vocab.compiler.compile(constraint).matcher()
    generator = torch.Generator().manual_seed(seed)
    tokens: list[int] = []
    for _ in range(max_steps):
        choices = allowed(vocab.masker.fill([matcher])[0], vocab.vocab_size)
        assert choices.any(), f"no token allowed after {vocab.decode(tokens)!r}"
        token = int(torch.multinomial(choices.float(), 1, generator=generator))
        assert matcher.accept(token), f"the mask allowed token {token}, but the matcher refused it"
        if token == vocab.eos:
            assert matcher.is_accepting
            return vocab.decode(tokens)
        tokens.append(token)
        if matcher.is_stopped:
            assert matcher.is_accepting
            return vocab.decode(tokens)
    raise AssertionError(f"no end after {max_steps} tokens: {vocab.decode(tokens)!r}")


def feed(vocab: Vocab, constraint: StructuredOutputs, text: str) -> GrammarMatcher:
    """A matcher advanced through text's tokens; fails the test if any is refused."""
    matcher = vocab.compiler.compile(constraint).matcher()
    for token in vocab.encode(text):
        assert matcher.accept(token), f"{text!r} refused"
    return matcher


def refuses(vocab: Vocab, constraint: StructuredOutputs, text: str) -> bool:
    matcher = vocab.compiler.compile(constraint).matcher()
    return not all(matcher.accept(token) for token in vocab.encode(text))


@pytest.mark.parametrize("seed", SEEDS)
def test_random_json_walks_follow_the_schema(vocab, seed):
    text = random_walk(vocab, spec(json=TOOL_SCHEMA, disable_any_whitespace=True), seed)
    jsonschema.validate(json.loads(text), TOOL_SCHEMA)
    assert " " not in text.split('"')[0]  # compact: no whitespace before the first key


@pytest.mark.parametrize("seed", SEEDS)
def test_random_json_walks_with_a_whitespace_pattern(vocab, seed):
    text = random_walk(vocab, spec(json=TOOL_SCHEMA, whitespace_pattern="[ ]?"), seed)
    jsonschema.validate(json.loads(text), TOOL_SCHEMA)
    assert "  " not in text.replace('"', "\0").split("\0")[0] and "\n" not in text.split('"')[0]


@pytest.mark.parametrize("seed", SEEDS)
def test_random_regex_walks_match(vocab, seed):
    assert re.fullmatch(DATE_REGEX, random_walk(vocab, spec(regex=DATE_REGEX), seed))


def test_random_choice_walks_give_a_choice(vocab):
    outputs = {random_walk(vocab, spec(choice=CHOICES), seed) for seed in range(12)}
    assert outputs <= set(CHOICES)
    assert len(outputs) > 1


@pytest.mark.parametrize("grammar, language", [(LARK, LARK_LANGUAGE), (GBNF, GBNF_LANGUAGE)], ids=["lark", "gbnf"])
def test_random_grammar_walks_are_in_the_language(vocab, grammar, language):
    for seed in SEEDS:
        assert re.fullmatch(language, random_walk(vocab, spec(grammar=grammar), seed))


def test_eos_is_allowed_only_where_the_json_is_complete(vocab):
    constraint = spec(json={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                      disable_any_whitespace=True)
    text = '{"a":12}'
    matcher = vocab.compiler.compile(constraint).matcher()
    tokens = vocab.encode(text)
    for token in tokens:
        assert not eos_allowed(vocab, matcher) and not matcher.is_accepting
        assert matcher.accept(token)
    assert matcher.is_accepting
    assert eos_allowed(vocab, matcher) or matcher.is_stopped  # a finished object takes nothing more
    assert matcher.accept(vocab.eos)
    assert matcher.is_stopped


def test_eos_after_a_json_number_that_may_go_on(vocab):
    matcher = vocab.compiler.compile(spec(json={"type": "integer"})).matcher()
    assert not eos_allowed(vocab, matcher)
    assert all(matcher.accept(token) for token in vocab.encode("12"))
    assert eos_allowed(vocab, matcher) and matcher.is_accepting and not matcher.is_stopped
    assert matcher.accept(vocab.eos) and matcher.is_stopped


def test_eos_where_the_grammar_may_go_on(vocab):
    matcher = feed(vocab, spec(regex="a+"), "aaa")
    row = allowed(vocab.masker.fill([matcher])[0], vocab.vocab_size)
    assert row[vocab.eos] and row[vocab.encode("a")[0]] and not matcher.is_stopped
    assert row.sum() < vocab.vocab_size // 2  # a mask, not all-allowed
    early = feed(vocab, spec(regex="ab+"), "a")
    assert not eos_allowed(vocab, early)
    assert not early.accept(vocab.eos) and early.is_error


def test_tokens_past_the_tokenizer_are_never_allowed(byte_vocab):
    matcher = byte_vocab.compiler.compile(spec(json_object=True)).matcher()
    row = allowed(byte_vocab.masker.fill([matcher])[0], byte_vocab.vocab_size)
    assert row[ord("{")] and not row[EOS_ID + 1:].any()


def test_expression_grammar_accepts_and_refuses(vocab):
    constraint = spec(grammar=EXPRESSION_GBNF)
    matcher = feed(vocab, constraint, "(12+3)*4-5/6")
    assert matcher.is_accepting and eos_allowed(vocab, matcher)
    assert refuses(vocab, constraint, "(12+*3)")


def test_whitespace_options(vocab):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    assert feed(vocab, spec(json=schema), '{ "a" :\n 1 }').is_accepting  # any whitespace by default
    assert refuses(vocab, spec(json=schema, disable_any_whitespace=True), '{ "a":1}')
    assert feed(vocab, spec(json=schema, disable_any_whitespace=True), '{"a":1}').is_accepting
    assert feed(vocab, spec(json=schema, whitespace_pattern=" ?"), '{ "a": 1}').is_accepting
    assert refuses(vocab, spec(json=schema, whitespace_pattern=" ?"), '{\n"a":1}')


def test_disable_additional_properties(vocab):
    schema = {"type": "object", "properties": {"a": {"type": "integer"},
                                               "inner": {"type": "object", "properties": {"b": {"type": "integer"}}}}}
    extra = '{"a":1,"z":2}'
    nested_extra = '{"inner":{"b":1,"z":2}}'
    assert feed(vocab, spec(json=schema), extra).is_accepting
    assert feed(vocab, spec(json=schema), nested_extra).is_accepting
    assert refuses(vocab, spec(json=schema, disable_additional_properties=True), extra)
    assert refuses(vocab, spec(json=schema, disable_additional_properties=True), nested_extra)
    assert feed(vocab, spec(json=schema, disable_additional_properties=True), '{"a":1,"inner":{"b":2}}').is_accepting


def test_json_object(vocab):
    assert feed(vocab, spec(json_object=True), '{"k": [1, {"z": null}], "s": "x"}').is_accepting
    assert refuses(vocab, spec(json_object=True), "[1]")


def test_the_true_schema_allows_any_json(byte_vocab):
    for options in ({}, {"disable_any_whitespace": True}, {"disable_additional_properties": True}):
        assert feed(byte_vocab, spec(json=True, **options), '[1,{"a":null}]').is_accepting
        assert feed(byte_vocab, spec(json="true", **options), '"text"').is_accepting
    assert refuses(byte_vocab, spec(json=True), "nope")


def test_structural_tag(byte_vocab):
    tag = {"type": "structural_tag", "triggers": ["<fn"],
           "structures": [{"begin": "<fn=add>", "schema": {"type": "object", "properties": {"x": {"type": "integer"}},
                                                           "required": ["x"]}, "end": "</fn>"}]}
    constraint = spec(structural_tag=tag, disable_any_whitespace=True)
    assert feed(byte_vocab, constraint, 'sure: <fn=add>{"x":3}</fn> done').is_accepting
    assert feed(byte_vocab, constraint, "no call at all").is_accepting
    assert refuses(byte_vocab, constraint, '<fn=add>{"x":"three"}')
    assert refuses(byte_vocab, constraint, '<fn=add>{ "x":3}')  # the JSON options reach the tag's schema


@pytest.mark.parametrize("fields, message", [
    ({"json": {"type": "foo"}}, r"structured_outputs\.json cannot be used: .*Invalid type: foo"),
    ({"json": {"type": "array", "uniqueItems": True}}, r"structured_outputs\.json cannot be used: .*uniqueItems"),
    ({"json": {"$ref": "#/$defs/missing"}}, r"structured_outputs\.json cannot be used: .*missing"),
    ({"json": {"type": "string", "pattern": "(("}}, r"(?s)structured_outputs\.json cannot be used: .*unclosed group"),
    ({"json": False}, r"structured_outputs\.json: the schema false allows no output at all"),
    ({"regex": "(("}, r"(?s)structured_outputs\.regex cannot be used: .*unclosed group"),
    ({"grammar": "start: missing_rule"}, r"structured_outputs\.grammar cannot be used: .*missing_rule"),
    ({"grammar": 'root ::= "a" b'}, r"structured_outputs\.grammar is not valid GBNF: .*'b'"),
    ({"json": {"type": "string", "format": "weird"}}, r"structured_outputs\.json cannot be used: .*format: weird"),
    ({"structural_tag": {"type": "structural_tag"}},  # neither form
     r"structured_outputs\.structural_tag is not supported by this server in this form: .* or a format"),
    ({"structural_tag": {"triggers": ["<a"], "structures": [{"begin": "<b>", "schema": {}, "end": ""}]}},
     r"structured_outputs\.structural_tag: begin '<b>' starts with none of the triggers"),
    ({"structural_tag": {"triggers": ["<a"], "structures": [{"begin": "<a>", "end": ""}]}},
     r"structured_outputs\.structural_tag: each structure needs begin and end strings and a schema object"),
])
def test_faults_are_value_errors(byte_vocab, fields, message):
    with pytest.raises(ValueError, match=message):
        byte_vocab.compiler.compile(spec(**fields))


def test_a_tokenizer_llguidance_cannot_read():
    with pytest.raises(ValueError, match="structured outputs cannot use this tokenizer"):
        GrammarCompiler(object(), 1000, 0)
    with pytest.raises(ValueError, match=r"structured outputs cannot use this tokenizer.*vocab size too small"):
        GrammarCompiler(byte_tokenizer(), 100, EOS_ID)


def test_compile_cache(byte_vocab):
    compiler = GrammarCompiler(byte_vocab.tokenizer, BYTE_VOCAB, EOS_ID, cache_size=2)
    first = compiler.compile(spec(regex="a+"))
    assert isinstance(first, CompiledGrammar) and first.spec == spec(regex="a+")
    assert compiler.compile(parse_structured_outputs('{"regex": "a+"}')) is first
    assert compiler.compile(spec(regex="a+", disable_any_whitespace=True)) is not first
    compiler.compile(spec(regex="a+"))  # first is now the most recent
    compiler.compile(spec(regex="b+"))  # evicts the whitespace variant, the least recent
    assert compiler.compile(spec(regex="a+")) is first
    assert len(compiler._cache) == 2


def test_concurrent_compiles_share_one_grammar(byte_vocab):
    compiler = GrammarCompiler(byte_vocab.tokenizer, BYTE_VOCAB, EOS_ID)
    results: list[CompiledGrammar] = []
    threads = [threading.Thread(target=lambda: results.append(compiler.compile(spec(json=TOOL_SCHEMA))))
               for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 4 and all(result is results[0] for result in results)


def test_matchers_are_independent(byte_vocab):
    compiled = byte_vocab.compiler.compile(spec(choice=["ab", "cd"]))
    first, second = compiled.matcher(), compiled.matcher()
    assert first.accept(ord("a"))
    assert second.accept(ord("c")) and not second.accept(ord("b"))
    assert first.accept(ord("b")) and first.is_accepting


def test_rollback_restores_the_mask(vocab):
    matcher = vocab.compiler.compile(spec(json=TOOL_SCHEMA, disable_any_whitespace=True)).matcher()
    tokens = vocab.encode('{"city":"Oslo","days":3')
    masks = []
    for token in tokens:
        masks.append(vocab.masker.fill([matcher])[0].clone())
        assert matcher.accept(token)
    for undo in (1, 2, len(tokens) - 2):
        matcher.rollback(undo)
        position = len(tokens) - undo
        assert torch.equal(vocab.masker.fill([matcher])[0], masks[position])
        for token in tokens[position:]:
            assert matcher.accept(token)


def test_rollback_past_eos(byte_vocab):
    stops = feed(byte_vocab, spec(regex="ab"), "ab")  # stopped: EOS is accepted but llguidance does not record it
    assert stops.is_stopped and stops.accept(EOS_ID)
    stops.rollback(1)
    assert stops.is_stopped
    stops.rollback(1)
    assert allowed(byte_vocab.masker.fill([stops])[0], BYTE_VOCAB).nonzero().flatten().tolist() == [ord("b")]
    goes_on = feed(byte_vocab, spec(regex="a+"), "a")  # not stopped: here EOS is recorded
    assert goes_on.accept(EOS_ID) and goes_on.is_stopped
    goes_on.rollback(1)
    assert allowed(byte_vocab.masker.fill([goes_on])[0], BYTE_VOCAB).nonzero().flatten().tolist() == [ord("a"), EOS_ID]


def test_rollback_refuses_what_it_cannot_undo(byte_vocab):
    matcher = feed(byte_vocab, spec(regex="abc"), "ab")
    with pytest.raises(ValueError, match="cannot roll back 3 tokens: 2 were accepted"):
        matcher.rollback(3)
    assert matcher.accept(ord("c")) and matcher.is_accepting  # left as it was
    assert not matcher.accept(ord("x")) and matcher.is_error
    with pytest.raises(ValueError, match="refused a token"):
        matcher.rollback(1)
    with pytest.raises(ValueError, match="non-negative"):
        matcher.accept(-1)


def test_masker_rows_without_a_constraint_allow_everything(byte_vocab):
    masker = TokenMasker(BYTE_VOCAB)
    constrained = byte_vocab.compiler.compile(spec(regex="[0-9]+")).matcher()
    stopped = feed(byte_vocab, spec(regex="x"), "x")
    errored = feed(byte_vocab, spec(regex="xy"), "x")
    assert not errored.accept(ord("z"))
    bitmask = masker.fill([None, constrained, None, stopped, errored])
    words = (BYTE_VOCAB + 31) // 32
    assert bitmask.shape == (5, words) and bitmask.dtype == torch.int32 and bitmask.device.type == "cpu"
    for row in (0, 2, 3, 4):
        assert (bitmask[row] == -1).all()
    assert allowed(bitmask[1], BYTE_VOCAB).nonzero().flatten().tolist() == list(range(ord("0"), ord("9") + 1))


def test_masker_reuses_its_buffer(byte_vocab):
    masker = TokenMasker(BYTE_VOCAB)
    matcher = byte_vocab.compiler.compile(spec(regex="[0-9]+")).matcher()
    first = masker.fill([matcher, None, None])
    pointer = first.data_ptr()
    assert masker.fill([None, matcher]).data_ptr() == pointer
    second = masker.fill([None, matcher, None])
    assert second.data_ptr() == pointer and (second[0] == -1).all() and not (second[1] == -1).all()
    compiled = byte_vocab.compiler.compile(spec(regex="[0-9]+"))
    grown = masker.fill([compiled.matcher() for _ in range(8)])  # each matcher in one row only
    assert grown.shape[0] == 8 and torch.equal(grown[7], grown[0]) and not (grown[0] == -1).all()
    assert masker.fill([]).shape == (0, (BYTE_VOCAB + 31) // 32)


def reference_mask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """apply_token_bitmask's answer, token by token."""
    expected = logits.clone()
    for row in range(logits.shape[0]):
        for token in range(logits.shape[1]):
            if not (int(bitmask[row, token // 32]) >> (token % 32)) & 1:
                expected[row, token] = float("-inf")
    return expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_apply_token_bitmask_matches_the_loop(dtype, device):
    generator = torch.Generator().manual_seed(0)
    rows, vocab_size = 3, 70  # 70 tokens: three words, the last one partly past the vocabulary
    logits = torch.randn(rows, vocab_size, generator=generator).to(dtype)
    bitmask = torch.randint(-2**31, 2**31 - 1, (rows + 2, 4), generator=generator, dtype=torch.int64).to(torch.int32)
    bitmask[0] = -1  # a row that allows everything
    bitmask[1, 0] = 0  # and one word that allows nothing
    expected = reference_mask(logits, bitmask)
    on_device = logits.to(device)
    apply_token_bitmask(on_device, bitmask)
    assert torch.equal(on_device.cpu(), expected)
    assert torch.isinf(expected).any() and not torch.isinf(expected[0]).any()


def test_apply_token_bitmask_checks_its_input():
    logits = torch.zeros(2, 70)
    with pytest.raises(ValueError, match=r"too small for logits \(2, 70\)"):
        apply_token_bitmask(logits, torch.full((2, 2), -1, dtype=torch.int32))
    with pytest.raises(ValueError, match="too small"):
        apply_token_bitmask(logits, torch.full((1, 3), -1, dtype=torch.int32))
    with pytest.raises(ValueError, match="int32"):
        apply_token_bitmask(logits, torch.full((2, 3), -1, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"logits must be \(rows, vocab\)"):
        apply_token_bitmask(torch.zeros(70), torch.full((2, 3), -1, dtype=torch.int32))


def test_masker_and_apply_together(byte_vocab):
    matcher = byte_vocab.compiler.compile(spec(choice=["yes", "no"])).matcher()
    logits = torch.zeros(2, BYTE_VOCAB)
    apply_token_bitmask(logits, byte_vocab.masker.fill([matcher, None]))
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [ord("n"), ord("y")]
    assert torch.isfinite(logits[1]).all()
