"""Structured outputs on CUDA with decode graphs, carry-over and the async pipeline: the random 1B shape (byte-level
tokenizer, random weights, so the model's own preference is noise) serves 256 constrained requests of mixed kinds
beside unconstrained ones with no violation."""
from __future__ import annotations

import json
import re

import pytest

from backend import Engine, EngineConfig, SamplingParams

pytestmark = pytest.mark.gpu
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {
    "type": "object",
    "properties": {"unit": {"type": "string", "enum": ["c", "f"]}, "n": {"type": "integer", "minimum": 0,
                                                                          "maximum": 999},
                   "ok": {"type": "boolean"}},
    "required": ["unit", "n", "ok"], "additionalProperties": False,
}
REGEX = r"[a-z]{3}-[0-9]{2}"
CHOICES = ["alpha", "beta", "gamma"]
KINDS = [{"json": SCHEMA, "disable_any_whitespace": True}, {"regex": REGEX}, {"choice": CHOICES}]


def _valid(kind: int, text: str) -> bool:
    if kind == 0:
        try:
            jsonschema.validate(json.loads(text), SCHEMA)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    if kind == 1:
        return re.fullmatch(REGEX, text) is not None
    return text in CHOICES


@pytest.mark.parametrize("async_pipeline", [True, False], ids=["async", "sync"])
def test_256_constrained_requests_beside_free_ones_have_no_violation(async_pipeline):
    engine = Engine(EngineConfig(model="random:llama-3.2-1b", device="cuda", max_num_seqs=256,
                                 async_pipeline=async_pipeline))
    try:
        prompts = [f"request {i}:" for i in range(320)]
        params = [SamplingParams(max_tokens=64, temperature=1.0, seed=i,
                                 structured_outputs=KINDS[i % 3] if i < 256 else None) for i in range(320)]
        outs = engine.generate(prompts, params)
    finally:
        engine.shutdown()
    bad = [(i, o.text) for i, o in enumerate(outs[:256]) if o.finish_reason != "stop" or not _valid(i % 3, o.text)]
    assert bad == [], bad[:5]
    assert all(o.token_ids for o in outs[256:])


def test_a_pinned_bitmask_masks_cuda_logits_as_the_cpu_does():
    """TokenMasker's page-locked bitmask copied without waiting (non_blocking) masks CUDA logits exactly as a
    pageable one masks CPU logits, for a vocabulary that is not a multiple of 32."""
    import torch

    from backend.models.random_model import byte_tokenizer
    from backend.structured.grammar import GrammarCompiler, TokenMasker, apply_token_bitmask
    from backend.structured.spec import parse_structured_outputs

    vocab = 1000
    compiler = GrammarCompiler(byte_tokenizer(), vocab, 256)
    matchers = [compiler.compile(parse_structured_outputs({"regex": REGEX})).matcher(), None,
                compiler.compile(parse_structured_outputs({"choice": CHOICES})).matcher()]
    logits = torch.randn(3, vocab)
    want = logits.clone()
    apply_token_bitmask(want, TokenMasker(vocab).fill(matchers))
    pinned = TokenMasker(vocab, pinned=True).fill(matchers)
    assert pinned.is_pinned()
    got = logits.cuda()
    apply_token_bitmask(got, pinned)
    assert torch.equal(got.cpu(), want)
