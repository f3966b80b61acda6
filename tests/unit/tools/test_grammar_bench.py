"""bench.grammar_bench's correctness checks pass for both grammar libraries on both tokenizers.

llguidance is a project dependency (structured outputs run on it); xgrammar is not (`pip install xgrammar`): where
it is missing, its tests are skipped, as they are in `make test`.
"""
from __future__ import annotations

import pytest

from bench import grammar_bench


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
