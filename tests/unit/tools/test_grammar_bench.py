"""bench.grammar_bench's correctness checks pass for both grammar libraries on its tokenizers, and on a Llama-3-style
tokenizer learned here.

llguidance is a project dependency (structured outputs run on it); xgrammar is not (`pip install xgrammar`): where
it is missing, its tests are skipped, as they are in `make test`.
"""
from __future__ import annotations

import pytest

from bench import grammar_bench, llama3_style_tokenizer


@pytest.fixture(scope="module")
def tokenizer_cases():
    return grammar_bench.load_tokenizers([])


@pytest.mark.parametrize("library", grammar_bench.LIBRARIES)
def test_valid_outputs_accepted_and_near_misses_refused(library, tokenizer_cases):
    pytest.importorskip(library)
    for case in tokenizer_cases:
        lib = grammar_bench.LIBRARY_CLASSES[library](case, threads=1)
        report = grammar_bench.check_correctness(lib, case)
        assert report["failures"] == [], (case.name, report["failures"])
        assert report["passed"] == report["checks"] == len(grammar_bench.PROBES) + 1


def test_a_wrong_expectation_is_reported(tokenizer_cases):
    """The checks can fail: a valid date said to break at its sixth character is reported as accepted there."""
    pytest.importorskip("xgrammar")
    case = tokenizer_cases[0]
    lib = grammar_bench.XGrammarLibrary(case, threads=1)
    failures = grammar_bench.check_probe(lib, case, grammar_bench.Probe("date", "regex", "2024-05-17", reject_at=5))
    assert len(failures) == 1 and "should be refused" in failures[0]


def test_the_oracle_knows_where_each_constraint_may_end():
    c = grammar_bench.CONSTRAINTS
    assert grammar_bench.is_complete("regex", c["regex"], "2024-05-17")
    assert not grammar_bench.is_complete("regex", c["regex"], "2024-05-1")
    assert grammar_bench.is_complete("choice", c["choice"], "kelvin")
    assert not grammar_bench.is_complete("choice", c["choice"], "kel")
    assert grammar_bench.is_complete("grammar", c["grammar"], "(12+3)")
    assert not grammar_bench.is_complete("grammar", c["grammar"], "(12+3)*")
    assert not grammar_bench.is_complete("grammar", c["grammar"], "-1")
    assert grammar_bench.is_complete("json", c["json"], grammar_bench.tool_call_arguments(3))


def test_tool_call_outputs_follow_the_schema():
    jsonschema = pytest.importorskip("jsonschema")
    import json

    for i in range(8):
        jsonschema.validate(json.loads(grammar_bench.tool_call_arguments(i)), grammar_bench.TOOL_SCHEMA)


def test_a_missing_library_is_named_with_how_to_install(monkeypatch, capsys):
    monkeypatch.setattr(grammar_bench, "missing_libraries", lambda names: ["llguidance"])
    assert grammar_bench.main(["--checks-only"]) == 2
    assert "pip install xgrammar llguidance" in capsys.readouterr().err


@pytest.fixture(scope="module")
def llama3_style_case():
    """A Llama-3-style tokenizer learned here from 2 MB of the installation's text (2,000 tokens, a second or two);
    the bench's own has 128,000 (bench/llama3_style_tokenizer.py)."""
    tok = llama3_style_tokenizer.build(learned=2000, corpus_bytes=2_000_000)
    return grammar_bench.TokenizerCase("llama-3-style-2k", tok, len(tok), tok.eos_token_id)


def test_the_llama3_style_tokenizer_has_llama3s_make(llama3_style_case):
    tok = llama3_style_case.tokenizer
    assert len(tok) == 2000 + 256
    specials = tok.convert_ids_to_tokens(list(range(2000, 2256)))
    assert specials[:11] == ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                             "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|reserved_special_token_2|>",
                             "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
    assert specials[-1] == "<|reserved_special_token_247|>" and tok.eos_token_id == 2009
    text = "Call get_weather({\"city\": \"Paris\", \"days\": 1234567}) — ok?\n"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text  # byte-level: every text round-trips
    # Llama 3's pattern: numbers in runs of at most three digits, a space before a word joins it, one before a
    # number stands alone
    words = [w for w, _ in tok.backend_tokenizer.pre_tokenizer.pre_tokenize_str("the days 1234567")]
    assert words == ["the", "Ġdays", "Ġ", "123", "456", "7"]


@pytest.mark.parametrize("library", grammar_bench.LIBRARIES)
def test_the_checks_pass_on_a_llama3_style_tokenizer(library, llama3_style_case):
    pytest.importorskip(library)
    lib = grammar_bench.LIBRARY_CLASSES[library](llama3_style_case, threads=1)
    report = grammar_bench.check_correctness(lib, llama3_style_case)
    assert report["failures"] == [] and report["passed"] == len(grammar_bench.PROBES) + 1, report["failures"]


def test_the_llama3_style_tokenizer_is_learned_once_then_read_from_the_cache(tmp_path, monkeypatch):
    first = llama3_style_tokenizer.load(learned=500, corpus_bytes=500_000, cache_dir=str(tmp_path))
    assert [p.name for p in tmp_path.iterdir()] == ["llama-3-style-tokenizer-500-from-500000-bytes"]
    monkeypatch.setattr(llama3_style_tokenizer, "build", lambda *a: pytest.fail("learned again"))
    again = llama3_style_tokenizer.load(learned=500, corpus_bytes=500_000, cache_dir=str(tmp_path))
    assert again.get_vocab() == first.get_vocab() and len(again) == 756
