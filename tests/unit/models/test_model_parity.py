"""Our Llama-family model against transformers on CPU, float32: prefill, chunked prefill, mixed batches."""
from __future__ import annotations

import time

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from backend.models import load_model, resolve_model_path
from backend.ops.attention_metadata import AttentionMetadata

ATOL = 1e-4
VOCAB = 128
_BASE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    tie_word_embeddings=False,
)
_LLAMA3_ROPE = dict(
    rope_type="llama3",
    rope_theta=10000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=32,
)
MODELS = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**_BASE)),
    "llama_tied": lambda: LlamaForCausalLM(LlamaConfig(**{**_BASE, "tie_word_embeddings": True})),
    "llama3_rope": lambda: LlamaForCausalLM(LlamaConfig(**_BASE, rope_parameters=_LLAMA3_ROPE)),
    "mistral": lambda: MistralForCausalLM(MistralConfig(**_BASE, sliding_window=None)),
    "qwen2_bias": lambda: Qwen2ForCausalLM(Qwen2Config(**_BASE)),
    "qwen3_qk_norm": lambda: Qwen3ForCausalLM(Qwen3Config(**_BASE, head_dim=32)),
}


def _randomize(model: torch.nn.Module) -> None:
    """HF zeroes biases and sets norms to one; random values make the parity test see them."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.1)


@pytest.fixture(scope="module", params=list(MODELS))
def pair(request, tmp_path_factory):
    """(transformers model, our model) with the same random weights, through a safetensors folder."""
    torch.manual_seed(0)
    hf = MODELS[request.param]().eval()
    _randomize(hf)
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder, safe_serialization=True)
    return hf, load_model(str(folder), dtype=torch.float32, device="cpu")


class PagedBatch:
    """A tiny stand-in for the runner: shuffled block allocation and per-step metadata."""

    def __init__(self, model, num_blocks: int = 48, block_size: int = 4, width: int = 12, seed: int = 0):
        self.model, self.bs, self.width = model, block_size, width
        # NaN-filled so any read of an unwritten slot shows up in the logits
        self.kv = torch.full(model.spec.kv_cache_shape(num_blocks, block_size), float("nan"))
        gen = torch.Generator().manual_seed(seed)
        self.free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()  # block 0 is for padding
        self.tables: dict[str, list[int]] = {}
        self.lens: dict[str, int] = {}

    def step(self, chunks: list[tuple[str, list[int]]], pad_rows: int = 0) -> torch.Tensor:
        """Run one step of (sequence, new tokens) chunks plus padding rows -> logits (T, V)."""
        ids, pos, slots, qsl, seq_lens, tables = [], [], [], [0], [], []
        for sid, toks in chunks:
            start = self.lens.get(sid, 0)
            table = self.tables.setdefault(sid, [])
            for i, tok in enumerate(toks):
                p = start + i
                if p // self.bs >= len(table):
                    table.append(self.free.pop())
                ids.append(tok), pos.append(p), slots.append(table[p // self.bs] * self.bs + p % self.bs)
            self.lens[sid] = start + len(toks)
            qsl.append(qsl[-1] + len(toks)), seq_lens.append(self.lens[sid])
            tables.append(table + [0] * (self.width - len(table)))
        for _ in range(pad_rows):  # padding rows: token 0 at position 0, written into block 0
            ids.append(0), pos.append(0), slots.append(0)
            qsl.append(qsl[-1] + 1), seq_lens.append(1), tables.append([0] * self.width)
        q_lens = [b - a for a, b in zip(qsl, qsl[1:])]
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=torch.tensor(tables, dtype=torch.int32),
            max_query_len=max(q_lens),
            max_seq_len=self.width * self.bs,  # an upper bound, as the runner may pass
        )
        hidden = self.model(torch.tensor(ids), torch.tensor(pos), self.kv, meta)  # (T, H)
        return self.model.compute_logits(hidden).float()  # (T, V)


def _hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()  # (T, V)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_full_prefill(pair):
    hf, ours = pair
    tokens = _prompt(21, seed=1)
    logits = PagedBatch(ours).step([("a", tokens)])
    torch.testing.assert_close(logits, _hf_logits(hf, tokens), atol=ATOL, rtol=0)


def test_chunked_prefill_shuffled_blocks(pair):
    hf, ours = pair
    tokens = _prompt(30, seed=2)
    batch = PagedBatch(ours, seed=3)
    outs, start = [], 0
    for size in (7, 5, 1, 10, 1, 6):
        outs.append(batch.step([("a", tokens[start : start + size])]))
        start += size
    assert batch.tables["a"] != sorted(batch.tables["a"])  # the cache really is non-contiguous
    torch.testing.assert_close(torch.cat(outs), _hf_logits(hf, tokens), atol=ATOL, rtol=0)


def test_mixed_batch_prefill_chunk_and_decodes(pair):
    hf, ours = pair
    seqs = {"a": _prompt(26, seed=4), "b": _prompt(12, seed=5), "c": _prompt(7, seed=6)}
    batch = PagedBatch(ours, seed=7)
    # step 1: a's first chunk with b's and c's prompts (all but their last token)
    first = batch.step([("a", seqs["a"][:9]), ("b", seqs["b"][:-1]), ("c", seqs["c"][:-1])])
    # step 2: a's second chunk, b and c decode one token each, plus two padding rows (a CUDA-graph batch)
    second = batch.step([("b", seqs["b"][-1:]), ("a", seqs["a"][9:]), ("c", seqs["c"][-1:])], pad_rows=2)
    ref = {k: _hf_logits(hf, v) for k, v in seqs.items()}
    torch.testing.assert_close(first[:9], ref["a"][:9], atol=ATOL, rtol=0)
    torch.testing.assert_close(first[9:20], ref["b"][:-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(first[20:26], ref["c"][:-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(second[0], ref["b"][-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(second[1:18], ref["a"][9:], atol=ATOL, rtol=0)
    torch.testing.assert_close(second[18], ref["c"][-1], atol=ATOL, rtol=0)
    assert torch.isfinite(second[19:]).all()  # padding rows must not produce NaNs


def test_builtin_model_converts_once_and_matches_greedy():
    path = resolve_model_path("smollm2-135m-instruct", cache_dir=None)  # converts on the first run only
    start = time.perf_counter()
    assert resolve_model_path("smollm2-135m-instruct", cache_dir=None) == path
    assert time.perf_counter() - start < 1.0
    tok = AutoTokenizer.from_pretrained(path)
    assert tok.chat_template
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    prompt = list(prompt["input_ids"] if isinstance(prompt, dict) else prompt)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0, len(prompt) :].tolist()
    ours = load_model(path, dtype=torch.float32, device="cpu")
    assert 2 in ours.spec.eos_token_ids
    batch, new, step = PagedBatch(ours, num_blocks=16, block_size=16, width=8), [], prompt
    for _ in range(6):
        new.append(int(batch.step([("s", step)])[-1].argmax()))
        step = new[-1:]
    assert new == ref


def test_unsupported_model_type_raises(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(ValueError, match="supported: llama"):
        load_model(str(tmp_path))


def test_pickle_only_checkpoint_raises(tmp_path):
    model = LlamaForCausalLM(LlamaConfig(**_BASE))
    model.config.save_pretrained(tmp_path)
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="pickle"):
        load_model(str(tmp_path))


def test_mistral_sliding_window_raises(tmp_path):
    MistralConfig(**_BASE, sliding_window=16).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="sliding-window"):
        load_model(str(tmp_path))


def test_bad_model_argument_raises(tmp_path):
    with pytest.raises(ValueError, match="local checkpoint folder, the alias"):
        resolve_model_path("no/such/model", cache_dir=str(tmp_path))
    with pytest.raises(ValueError, match="config.json"):
        resolve_model_path(str(tmp_path), cache_dir=str(tmp_path))
