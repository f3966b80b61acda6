"""The built-in SmolLM2-135M-Instruct: greedy text equal to transformers, stop strings, streaming deltas."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from backend import Engine, EngineConfig, SamplingParams
from backend.models import resolve_model_path

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "List three colours:",
]


@pytest.fixture(scope="module")
def path():
    return resolve_model_path("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def reference(path):
    """transformers' greedy continuations, generated as one left-padded batch (the same tokens as one prompt at a
    time, in a third of the time)."""
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    chat = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}], tokenize=False,
                                   add_generation_prompt=True)
    prompts = PROMPTS + [chat]
    ids = [tok.encode(p) for p in prompts]
    width, pad = max(map(len, ids)), tok.eos_token_id
    batch = torch.tensor([[pad] * (width - len(i)) + i for i in ids])
    mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids])
    with torch.no_grad():
        gen = model.generate(batch, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=pad)
    # a row that ended with EOS is padded with more of it up to the longest row
    out = [row[:row.index(pad) + 1] if pad in row else row for row in gen[:, width:].tolist()]
    return tok, prompts, out


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def engine(path, request):
    eng = Engine(EngineConfig(model="smollm2-135m-instruct", device="cpu", num_kv_blocks=256,
                              max_num_batched_tokens=64, max_num_seqs=8, async_pipeline=request.param))
    yield eng
    eng.shutdown()


def test_greedy_equals_transformers(engine, reference):
    tok, prompts, want = reference
    outs = engine.generate(prompts, SamplingParams(max_tokens=24, temperature=0))
    for out, ref in zip(outs, want):
        assert out.token_ids == ref
        # transformers stops after EOS; its text is our text (EOS itself is not text)
        assert out.text == tok.decode(ref, skip_special_tokens=True)
    assert outs[-1].finish_reason == "stop"  # the chat answer ends with EOS
    assert "4" in outs[-1].text


def test_stop_string_truncates_exactly(engine, reference):
    tok, prompts, want = reference
    full = tok.decode(want[2], skip_special_tokens=True)
    stop = full[10:16]
    cut = full.index(stop)
    out = engine.generate([prompts[2]], SamplingParams(max_tokens=24, temperature=0, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == full[:cut]
    kept = engine.generate([prompts[2]], SamplingParams(max_tokens=24, temperature=0, stop=[stop],
                                                        include_stop_str_in_output=True))[0]
    assert kept.text == full[:cut + len(stop)]


def test_streaming_deltas_concatenate(engine, reference):
    tok, prompts, want = reference
    stream = engine.add_request(prompts[1], SamplingParams(max_tokens=24, temperature=0))
    deltas, ids = [], []
    for out in stream:
        deltas.append(out.delta_text)
        ids += out.delta_token_ids
        assert "\ufffd" not in out.delta_text
    assert ids == want[1]
    assert "".join(deltas) == tok.decode(want[1], skip_special_tokens=True)
