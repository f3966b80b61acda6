"""python -m bench.grammar_bench: xgrammar beside llguidance, the candidate grammar libraries for structured outputs.

llguidance is a project dependency (structured outputs run on it); xgrammar is not: `pip install xgrammar`
(measured with xgrammar 0.2.9, llguidance 1.9.1).
On the default model's tokenizer (SmolLM2: 49,152 tokens) and the byte-level tokenizer the random Llama-3 shapes are
served with (257 tokens in a 128,256-wide vocabulary; `--tokenizer` adds a checkpoint folder's, or with
`--tokenizer llama-3-style` one of 128,256 tokens made like Llama 3's), for each library:
building its tokenizer info; compiling a tool-call JSON schema, a regex, a choice and an EBNF grammar, cold and
cached, and the first mask after a cold compile; filling the token bitmask for 1, 32 and 256 rows, each row its own
matcher advanced through valid tool calls; correctness (valid outputs accepted token by token with EOS allowed only
where the grammar may end, invalid ones refused at the token that breaks them, the first mask); and which
JSON-schema keywords each compiles and enforces. Prints its settings, a table, and one JSON line of results.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from bench import llama3_style_tokenizer

LIBRARIES = ("xgrammar", "llguidance")
LLAMA3_STYLE = "llama-3-style"  # --tokenizer's name for bench/llama3_style_tokenizer.py's 128,256-token vocabulary
INSTALL_HINT = "pip install xgrammar llguidance"

TOOL_SCHEMA = {  # an OpenAI function's parameters, as a forced tool call sends them
    "type": "object",
    "properties": {
        "city": {"type": "string", "description": "the city, e.g. Paris"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "min_confidence": {"type": "number", "minimum": 0, "maximum": 1},
        "tags": {"type": "array", "items": {"type": "string"}},
        "location": {
            "type": "object",
            "properties": {"lat": {"type": "number", "minimum": -90, "maximum": 90},
                           "lon": {"type": "number", "minimum": -180, "maximum": 180}},
            "required": ["lat", "lon"],
            "additionalProperties": False,
        },
    },
    "required": ["city", "unit", "days", "location"],
    "additionalProperties": False,
}
DATE_REGEX = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"
CHOICES = ["celsius", "fahrenheit", "kelvin"]
EXPRESSION_EBNF = """root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= number | "(" expr ")"
number ::= [0-9]+
"""
CONSTRAINTS = {"json": json.dumps(TOOL_SCHEMA), "regex": DATE_REGEX, "choice": json.dumps(CHOICES),
               "grammar": EXPRESSION_EBNF}

CITIES = ["Paris", "San Francisco", "Tokyo", "Reykjavik", "Buenos Aires", "Cape Town", "Oslo", "Mumbai"]
TAGS = ["rain", "wind", "snow", "sun", "fog", "storm"]


def tool_call_arguments(index: int) -> str:
    """A valid output for TOOL_SCHEMA, different for each index, its keys in the schema's order."""
    rng = random.Random(index)
    args = {"city": CITIES[index % len(CITIES)], "unit": rng.choice(["celsius", "fahrenheit"]),
            "days": rng.randint(1, 14)}
    if index % 2 == 0:
        args["min_confidence"] = round(rng.random(), 2)
    if index % 3:
        args["tags"] = rng.sample(TAGS, rng.randint(0, 3))
    args["location"] = {"lat": round(rng.uniform(-90, 90), 4), "lon": round(rng.uniform(-180, 180), 4)}
    return json.dumps(args)


@dataclass
class Probe:
    """A constraint and a text fed to it token by token; reject_at: the offset of the first character no valid output
    has there (None: the text is valid and must end the grammar)."""

    name: str
    kind: str
    text: str
    reject_at: int | None = None


def near_miss(name: str, kind: str, text: str, first_wrong: str) -> Probe:
    """A probe that must be refused where first_wrong first occurs in text."""
    return Probe(name, kind, text, reject_at=text.index(first_wrong))


PROBES = [
    Probe("json valid", "json", tool_call_arguments(0)),
    near_miss("json wrong enum", "json", '{"city": "Paris", "unit": "kelvin", "days": 3}', "kelvin"),
    near_miss("json missing required", "json", '{"city": "Paris", "unit": "celsius"}', "}"),  # days, location
    Probe("regex match", "regex", "2024-05-17"),
    near_miss("regex near miss", "regex", "2024/05/17", "/"),
    Probe("choice match", "choice", "fahrenheit"),
    near_miss("choice near miss", "choice", "celcius", "ci"),
    Probe("grammar match", "grammar", "(12+3)*4-5/6"),
    near_miss("grammar near miss", "grammar", "(12+*3)", "*"),
]

# JSON-schema keywords beyond the tool schema's: (keyword, schema, a valid instance, one that breaks only that keyword)
KEYWORD_PROBES = [
    ("pattern", {"type": "string", "pattern": "^[A-Z]{3}$"}, '"ABC"', '"AB1"'),
    ("format: date", {"type": "string", "format": "date"}, '"2024-05-17"', '"tomorrow"'),
    ("format: email", {"type": "string", "format": "email"}, '"a@b.io"', '"a.b.io"'),
    ("minLength/maxLength", {"type": "string", "minLength": 2, "maxLength": 3}, '"ab"', '"abcd"'),
    ("minItems/maxItems", {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 2}, "[1, 2]",
     "[1, 2, 3]"),
    ("integer minimum/maximum", {"type": "integer", "minimum": 1, "maximum": 14}, "14", "15"),
    ("number minimum/maximum", {"type": "number", "minimum": 0, "maximum": 1}, "0.5", "1.5"),
    ("exclusiveMinimum", {"type": "number", "exclusiveMinimum": 0}, "0.5", "0"),
    ("multipleOf", {"type": "integer", "multipleOf": 5}, "15", "12"),
    ("const", {"const": "v1"}, '"v1"', '"v2"'),
    ("enum of mixed types", {"enum": [1, "a", None]}, "null", "2"),
    ("anyOf", {"anyOf": [{"type": "integer"}, {"type": "string", "enum": ["auto"]}]}, '"auto"', '"manual"'),
    ("oneOf", {"oneOf": [{"type": "integer"}, {"type": "boolean"}]}, "true", '"x"'),
    ("allOf", {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                         {"type": "object", "properties": {"b": {"type": "string"}}, "required": ["b"]}]},
     '{"a": 1, "b": "x"}', '{"a": 1}'),
    ("$ref recursive", {"$defs": {"node": {"type": "object", "properties": {
        "v": {"type": "integer"}, "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}},
        "required": ["v", "next"], "additionalProperties": False}}, "$ref": "#/$defs/node"},
     '{"v": 1, "next": {"v": 2, "next": null}}', '{"v": 1, "next": {"v": "x", "next": null}}'),
    ("additionalProperties: schema", {"type": "object", "additionalProperties": {"type": "integer"}}, '{"x": 1}',
     '{"x": "y"}'),
    ("additionalProperties: false", {"type": "object", "properties": {"a": {"type": "integer"}},
                                     "additionalProperties": False}, '{"a": 1}', '{"a": 1, "b": 2}'),
    ("patternProperties", {"type": "object", "patternProperties": {"^x_": {"type": "integer"}},
                           "additionalProperties": False}, '{"x_a": 1}', '{"y": 1}'),
    ("uniqueItems", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1, 2]", "[1, 1]"),
    ("not", {"not": {"type": "string"}}, "1", '"x"'),
]


def is_complete(kind: str, constraint: str, text: str) -> bool:
    """Whether text is a whole output of the constraint, decided without either library."""
    if kind == "json":
        try:
            json.loads(text)
        except ValueError:
            return False
        return True  # the probes' JSON texts are objects: a prefix parses only when it is the whole text
    if kind == "regex":
        import re

        return re.fullmatch(constraint, text) is not None
    if kind == "choice":
        return text in json.loads(constraint)
    if kind == "grammar":  # EXPRESSION_EBNF's language: + - * / on unsigned integers and parentheses, no spaces
        if not text or set(text) - set("0123456789+-*/()"):
            return False
        try:
            tree = ast.parse(text, mode="eval")
        except SyntaxError:
            return False
        allowed = (ast.Expression, ast.BinOp, ast.Constant, ast.Add, ast.Sub, ast.Mult, ast.Div)
        return all(isinstance(node, allowed) for node in ast.walk(tree))
    raise ValueError(kind)


@dataclass
class TokenizerCase:
    """A tokenizer the grammars are compiled for, with the model's vocabulary size (the bitmask's width)."""

    name: str
    tokenizer: object
    vocab_size: int
    eos_id: int

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, clean_up_tokenization_spaces=False)


def load_tokenizers(extra_folders: list[str]) -> list[TokenizerCase]:
    from transformers import AutoTokenizer

    from backend.models import DEFAULT_ALIAS, resolve_model_path
    from backend.models.random_model import EOS_ID, SHAPES, byte_tokenizer

    cases = []
    for name, folder in [("smollm2", resolve_model_path(DEFAULT_ALIAS))] + [(os.path.basename(f.rstrip("/")), f)
                                                                         for f in extra_folders]:
        if folder == LLAMA3_STYLE:
            tok = llama3_style_tokenizer.load()
            cases.append(TokenizerCase(LLAMA3_STYLE, tok, SHAPES["llama-3-8b"]["vocab_size"], tok.eos_token_id))
            continue
        tok = AutoTokenizer.from_pretrained(folder)
        config = os.path.join(folder, "config.json")
        vocab = json.load(open(config))["vocab_size"] if os.path.isfile(config) else len(tok)
        cases.append(TokenizerCase(name, tok, vocab, tok.eos_token_id))
    cases.insert(1, TokenizerCase("llama-3-byte", byte_tokenizer(), SHAPES["llama-3-8b"]["vocab_size"], EOS_ID))
    return cases


class XGrammarLibrary:
    """xgrammar behind the benchmark's interface: a GrammarCompiler (it caches by grammar) and a GrammarMatcher per
    row, masks filled by a BatchGrammarMatcher."""

    name = "xgrammar"

    def __init__(self, case: TokenizerCase, threads: int):
        import xgrammar

        self.xgr = xgrammar
        self.vocab_size = case.vocab_size
        self.info = xgrammar.TokenizerInfo.from_huggingface(case.tokenizer, vocab_size=case.vocab_size,
                                                            stop_token_ids=[case.eos_id])
        self.compiler = xgrammar.GrammarCompiler(self.info, max_threads=threads)
        self.batch = xgrammar.BatchGrammarMatcher(max_threads=threads)

    def compile(self, kind: str, text: str):
        if kind == "json":  # vLLM's defaults: any whitespace, no properties beyond the schema's
            return self.compiler.compile_json_schema(text, any_whitespace=True)
        if kind == "regex":
            return self.compiler.compile_regex(text)
        if kind == "choice":  # no choice API: an EBNF of the quoted strings
            return self.compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in json.loads(text)))
        if kind == "grammar":  # GBNF, as llama.cpp writes it
            return self.compiler.compile_grammar(text)
        raise ValueError(kind)

    def forget_compiled(self) -> None:
        self.compiler.clear_cache()

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def allocate(self, rows: int) -> torch.Tensor:
        return self.xgr.allocate_token_bitmask(rows, self.vocab_size)

    def fill(self, matchers: list, bitmask: torch.Tensor) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def fill_serial(self, matchers: list, bitmask: torch.Tensor) -> None:
        for row, matcher in enumerate(matchers):
            matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)

    def accept_batch(self, matchers: list, tokens: list[int]) -> list[bool]:
        return self.xgr.BatchGrammarMatcher.batch_accept_token(matchers, tokens)

    def reset(self, matcher) -> None:
        matcher.reset()

    def finished(self, matcher) -> bool:
        return matcher.is_terminated()


class LLGuidanceLibrary:
    """llguidance behind the benchmark's interface: each grammar built once into a template LLMatcher kept by its
    text (the library has no compiled-grammar cache of its own), a deep copy per row, masks filled by an LLExecutor."""

    name = "llguidance"
    FORMATS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "gbnf"}

    def __init__(self, case: TokenizerCase, threads: int):
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg = llguidance
        self.vocab_size = case.vocab_size
        self.tokenizer = llguidance.hf.from_tokenizer(case.tokenizer, n_vocab=case.vocab_size, eos_token=case.eos_id)
        self.executor = llguidance.LLExecutor(num_threads=threads)
        self.templates: dict[tuple[str, str], object] = {}

    def compile(self, kind: str, text: str):
        key = (kind, text)
        if key not in self.templates:
            grammar = self.llg.grammar_from(self.FORMATS[kind], text)  # gbnf: its own GBNF-to-Lark conversion
            template = self.llg.LLMatcher(self.tokenizer, grammar, log_level=0)
            if template.is_error():
                raise ValueError(template.get_error())
            self.templates[key] = template
        return self.templates[key]

    def forget_compiled(self) -> None:
        self.templates.clear()

    def matcher(self, compiled):
        return compiled.deep_copy()

    def allocate(self, rows: int) -> torch.Tensor:
        return self.llg.torch.allocate_token_bitmask(rows, self.vocab_size)

    def fill(self, matchers: list, bitmask: torch.Tensor) -> None:
        self.llg.torch.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

    def fill_serial(self, matchers: list, bitmask: torch.Tensor) -> None:
        for row, matcher in enumerate(matchers):
            self.llg.torch.fill_next_token_bitmask(matcher, bitmask, row)

    def accept(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)

    def accept_batch(self, matchers: list, tokens: list[int]) -> list[bool]:
        return self.executor.consume_token_par(list(zip(matchers, tokens)))

    def reset(self, matcher) -> None:
        matcher.reset()

    def finished(self, matcher) -> bool:
        return matcher.is_stopped()


LIBRARY_CLASSES = {"xgrammar": XGrammarLibrary, "llguidance": LLGuidanceLibrary}


def allowed(bitmask_row: torch.Tensor, token: int) -> bool:
    return bool((int(bitmask_row[token // 32]) >> (token % 32)) & 1)


def check_probe(lib, case: TokenizerCase, probe: Probe) -> list[str]:
    """Feed probe.text token by token, filling the mask before each; returns what went wrong (empty: all right)."""
    constraint = CONSTRAINTS[probe.kind]
    ids = case.encode(probe.text)
    ends = [len(case.decode(ids[:i + 1])) for i in range(len(ids))]  # characters decoded after each token
    reject_token = None if probe.reject_at is None else next(i for i, end in enumerate(ends) if end > probe.reject_at)
    matcher = lib.matcher(lib.compile(probe.kind, constraint))
    bitmask = lib.allocate(1)
    failures = []
    for i, token in enumerate(ids):
        lib.fill([matcher], bitmask)
        prefix = case.decode(ids[:i])
        if allowed(bitmask[0], case.eos_id) != is_complete(probe.kind, constraint, prefix):
            failures.append(f"EOS {'allowed' if allowed(bitmask[0], case.eos_id) else 'refused'} after {prefix!r}")
        in_mask, accepted = allowed(bitmask[0], token), lib.accept(matcher, token)
        piece = case.decode([token])
        if i == reject_token:
            if in_mask or accepted:
                failures.append(f"token {i} {piece!r} after {prefix!r}: in mask {in_mask}, accepted {accepted}; "
                                f"should be refused")
            return failures
        if not (in_mask and accepted):
            failures.append(f"token {i} {piece!r} after {prefix!r}: in mask {in_mask}, accepted {accepted}")
            return failures
    if probe.reject_at is not None:
        return failures + ["the text ended before the token that should be refused"]
    lib.fill([matcher], bitmask)
    if not allowed(bitmask[0], case.eos_id):
        failures.append("EOS not allowed at the end")
    if not (lib.accept(matcher, case.eos_id) and lib.finished(matcher)):
        failures.append("EOS at the end did not finish the matcher")
    return failures


def check_first_mask(lib, case: TokenizerCase) -> list[str]:
    """The tool schema's first mask: `{` allowed, a letter and EOS not."""
    bitmask = lib.allocate(1)
    lib.fill([lib.matcher(lib.compile("json", CONSTRAINTS["json"]))], bitmask)
    brace, letter = case.tokenizer.convert_tokens_to_ids("{"), case.tokenizer.convert_tokens_to_ids("a")
    failures = []
    if not allowed(bitmask[0], brace):
        failures.append("first mask refuses '{'")
    if allowed(bitmask[0], letter):
        failures.append("first mask allows 'a'")
    if allowed(bitmask[0], case.eos_id):
        failures.append("first mask allows EOS")
    return failures


def check_correctness(lib, case: TokenizerCase) -> dict:
    """Every probe and the first mask; passed counts the checks without a failure."""
    results = {probe.name: check_probe(lib, case, probe) for probe in PROBES}
    results["json first mask"] = check_first_mask(lib, case)
    failures = [f"{name}: {f}" for name, fs in results.items() for f in fs]
    return {"passed": sum(not fs for fs in results.values()), "checks": len(results), "failures": failures}


def accepts_whole(lib, compiled, case: TokenizerCase, text: str) -> bool:
    matcher = lib.matcher(compiled)
    return all(lib.accept(matcher, t) for t in case.encode(text)) and lib.accept(matcher, case.eos_id)


def keyword_coverage(lib, case: TokenizerCase) -> dict[str, str]:
    """Per keyword: enforced, ignored (the breaking instance accepted), refuses valid, or the compile error."""
    coverage = {}
    for keyword, schema, valid, invalid in KEYWORD_PROBES:
        try:
            compiled = lib.compile("json", json.dumps(schema))
        except Exception as e:  # noqa: BLE001 - either library's way of refusing a schema
            coverage[keyword] = "error: " + str(e).strip().splitlines()[0][:80]
            continue
        if not accepts_whole(lib, compiled, case, valid):
            coverage[keyword] = "refuses valid"
        else:
            coverage[keyword] = "ignored" if accepts_whole(lib, compiled, case, invalid) else "enforced"
    return coverage


def time_compiles(lib, repeats: int) -> dict:
    """Per constraint: a cold compile and matcher (compiled grammars forgotten first), its first mask, and the same
    constraint again (cached); milliseconds, medians over repeats (cold_first_ms: the process's first)."""
    results = {}
    bitmask = lib.allocate(1)
    for kind, text in CONSTRAINTS.items():
        cold, first_mask, cached = [], [], []
        for _ in range(repeats):
            lib.forget_compiled()
            start = time.perf_counter()
            matcher = lib.matcher(lib.compile(kind, text))
            cold.append(time.perf_counter() - start)
            start = time.perf_counter()
            lib.fill([matcher], bitmask)
            first_mask.append(time.perf_counter() - start)
        for _ in range(repeats):
            start = time.perf_counter()
            lib.matcher(lib.compile(kind, text))
            cached.append(time.perf_counter() - start)
        results[kind] = {"cold_ms": _ms(statistics.median(cold)), "cold_first_ms": _ms(cold[0]),
                         "first_mask_ms": _ms(statistics.median(first_mask)),
                         "cached_ms": _ms(statistics.median(cached))}
    return results


def time_masks(lib, case: TokenizerCase, rows: int, steps: int, documents: int = 8) -> dict:
    """Each row its own matcher of the tool schema, walking a valid tool call (rows start at staggered offsets; at
    its end a row accepts EOS and starts over). Per step, each timed: the rows' masks filled one by one on this
    thread (serial), then by the library's batched call on its thread pool (batched), then one batched accept.
    Checked every step: both fills agree and every row's next token is allowed."""
    compiled = lib.compile("json", CONSTRAINTS["json"])
    outputs = [case.encode(tool_call_arguments(i)) + [case.eos_id] for i in range(documents)]
    warm = lib.matcher(compiled)  # lazily built parser and lexer states, as a grammar seen before has them
    warm_mask = lib.allocate(1)
    for token in outputs[0]:
        lib.fill([warm], warm_mask)
        lib.accept(warm, token)
    matchers = [lib.matcher(compiled) for _ in range(rows)]
    positions = []
    for r, matcher in enumerate(matchers):
        output = outputs[r % documents]
        positions.append((r * 7) % (len(output) - 1))
        if not all(lib.accept(matcher, token) for token in output[:positions[-1]]):
            raise AssertionError(f"{lib.name}: a valid row's token was not accepted")
    bitmask, serial_bitmask = lib.allocate(rows), lib.allocate(rows)
    row_index = torch.arange(rows)
    timings: dict[str, list[float]] = {"batched": [], "serial": [], "accept": []}
    for _ in range(steps):
        start = time.perf_counter()
        lib.fill_serial(matchers, serial_bitmask)
        timings["serial"].append(time.perf_counter() - start)
        start = time.perf_counter()
        lib.fill(matchers, bitmask)
        timings["batched"].append(time.perf_counter() - start)
        if not torch.equal(bitmask, serial_bitmask):
            raise AssertionError(f"{lib.name}: the batched fill differs from the rows filled one by one")
        tokens = [outputs[r % documents][p] for r, p in enumerate(positions)]
        wanted = torch.tensor(tokens)
        if not bool(((bitmask[row_index, wanted // 32] >> (wanted % 32)) & 1).all()):
            raise AssertionError(f"{lib.name}: the mask refuses a valid row's next token")
        start = time.perf_counter()
        accepted = lib.accept_batch(matchers, tokens)
        timings["accept"].append(time.perf_counter() - start)
        if not all(accepted):
            raise AssertionError(f"{lib.name}: a valid row's token was not accepted")
        for r, matcher in enumerate(matchers):
            positions[r] += 1
            if positions[r] == len(outputs[r % documents]):  # EOS accepted: a new request in its place
                lib.reset(matcher)
                positions[r] = 0
    result = {"rows": rows, "steps": steps}
    for name, seconds in timings.items():
        us = sorted(s * 1e6 for s in seconds)
        result[f"{name}_median_us"] = round(statistics.median(us), 1)
        result[f"{name}_p99_us"] = round(us[min(len(us) - 1, int(0.99 * len(us)))], 1)
    result["batched_us_per_row"] = round(result["batched_median_us"] / rows, 2)
    result["serial_us_per_row"] = round(result["serial_median_us"] / rows, 2)
    return result


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


def run_library(name: str, case: TokenizerCase, args, coverage: bool) -> dict:
    start = time.perf_counter()
    lib = LIBRARY_CLASSES[name](case, args.threads)
    result = {"tokenizer_info_ms": _ms(time.perf_counter() - start)}
    if not args.checks_only:
        result["compile"] = time_compiles(lib, args.repeats)
    result["correctness"] = check_correctness(lib, case)
    if not args.checks_only:
        result["mask"] = {str(rows): time_masks(lib, case, rows, args.steps) for rows in args.rows}
    if coverage:
        result["keywords"] = keyword_coverage(lib, case)
    return result


def missing_libraries(names) -> list[str]:
    import importlib.util

    return [n for n in names if importlib.util.find_spec(n) is None]


def print_tables(results: dict, cases: list[TokenizerCase], libraries: list[str]) -> None:
    if all("compile" in results[n][c.name] for n in libraries for c in cases):
        print("\ncompile (ms): cold = compiled grammars forgotten first; then the first mask; cached = the same again")
        print(f"{'library':11s} {'tokenizer':13s} {'tok info':>9s}  " + "  ".join(
            f"{kind + ' cold/first mask/cached':>30s}" for kind in CONSTRAINTS))
        for name in libraries:
            for case in cases:
                r = results[name][case.name]
                cells = [f"{c['cold_ms']:.2f} / {c['first_mask_ms']:.3f} / {c['cached_ms']:.3f}"
                         for c in r["compile"].values()]
                print(f"{name:11s} {case.name:13s} {r['tokenizer_info_ms']:9.1f}  "
                      + "  ".join(f"{c:>30s}" for c in cells))
    if any("mask" in results[n][c.name] for n in libraries for c in cases):
        print("\nmask fill per step (µs), each row its own matcher of the tool schema: batched = the library's batched "
              "call, serial = row by row on the calling thread; accept = advancing every row (batched call)")
        print(f"{'library':11s} {'tokenizer':13s} {'rows':>5s} {'batched':>9s} {'p99':>9s} {'per row':>8s} "
              f"{'serial':>9s} {'p99':>9s} {'per row':>8s} {'accept':>8s} {'p99':>8s}")
        for name in libraries:
            for case in cases:
                for m in results[name][case.name].get("mask", {}).values():
                    print(f"{name:11s} {case.name:13s} {m['rows']:5d} {m['batched_median_us']:9.1f} "
                          f"{m['batched_p99_us']:9.1f} {m['batched_us_per_row']:8.2f} {m['serial_median_us']:9.1f} "
                          f"{m['serial_p99_us']:9.1f} {m['serial_us_per_row']:8.2f} {m['accept_median_us']:8.1f} "
                          f"{m['accept_p99_us']:8.1f}")
    print("\ncorrectness")
    for name in libraries:
        for case in cases:
            c = results[name][case.name]["correctness"]
            print(f"{name:11s} {case.name:13s} {c['passed']}/{c['checks']} checks passed"
                  + "".join(f"\n    {f}" for f in c["failures"]))
    coverage = {n: results[n][cases[0].name].get("keywords") for n in libraries}
    if all(coverage.values()):
        print(f"\nJSON-schema keywords ({cases[0].name}): enforced, ignored (a breaking instance accepted), "
              "refuses valid, or error")
        print(f"{'keyword':30s} " + " ".join(f"{n:40s}" for n in libraries))
        for keyword, *_ in KEYWORD_PROBES:
            print(f"{keyword:30s} " + " ".join(f"{coverage[n][keyword]:40s}" for n in libraries))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--libraries", default=",".join(LIBRARIES))
    ap.add_argument("--rows", default="1,32,256", help="batch sizes of the mask fill")
    ap.add_argument("--steps", type=int, default=200, help="timed steps per batch size")
    ap.add_argument("--repeats", type=int, default=5, help="compiles per constraint, cold and cached")
    ap.add_argument("--threads", type=int, default=os.cpu_count(),
                    help="threads of each library's batched fill and compiler (default: every CPU)")
    ap.add_argument("--tokenizer", action="append", default=[], metavar="FOLDER",
                    help="also a checkpoint folder's tokenizer (its config.json's vocab_size is the mask's width), "
                         f"or {LLAMA3_STYLE}: a tokenizer made like Llama 3's (bench/llama3_style_tokenizer.py)")
    ap.add_argument("--checks-only", action="store_true", help="correctness and keywords only, no timings")
    ap.add_argument("--no-keywords", dest="keywords", action="store_false", help="skip the JSON-schema keywords")
    args = ap.parse_args(argv)
    libraries = args.libraries.split(",")
    args.rows = [int(r) for r in args.rows.split(",")]
    if unknown := set(libraries) - set(LIBRARIES):
        ap.error(f"unknown libraries {sorted(unknown)}; known: {', '.join(LIBRARIES)}")
    if missing := missing_libraries(libraries):
        print(f"bench.grammar_bench needs {' and '.join(missing)}, which the project does not install: "
              f"{INSTALL_HINT}", file=sys.stderr)
        return 2
    from importlib.metadata import version

    versions = {name: version(name) for name in libraries}
    cases = load_tokenizers(args.tokenizer)
    print(f"# grammar_bench: {', '.join(f'{n} {v}' for n, v in versions.items())}; threads {args.threads} of "
          f"{os.cpu_count()} CPUs; rows {args.rows}, {args.steps} steps each; {args.repeats} compiles per constraint; "
          f"tokenizers " + ", ".join(f"{c.name} ({len(c.tokenizer):,} tokens, mask {c.vocab_size:,}, EOS {c.eos_id})"
                                     for c in cases) + f"; torch {torch.__version__}", flush=True)
    results = {name: {} for name in libraries}
    for name in libraries:
        for case in cases:
            results[name][case.name] = run_library(name, case, args, args.keywords and case is cases[0])
            print(f"# {name} on {case.name} done", flush=True)
    print_tables(results, cases, libraries)
    print(json.dumps({"versions": versions, "threads": args.threads, "cpus": os.cpu_count(), "rows": args.rows,
                      "steps": args.steps, "tokenizers": {c.name: {"tokens": len(c.tokenizer), "mask": c.vocab_size}
                                                         for c in cases}, "results": results},
                     separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
