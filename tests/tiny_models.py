"""Tiny random checkpoints of each supported family, built in code, and transformers' greedy reference."""
from __future__ import annotations

import os
import time

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen3Config

VOCAB = 256
EOS = 255


def _config(family: str):
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  eos_token_id=EOS, bos_token_id=1, tie_word_embeddings=False)
    if family == "llama":
        return LlamaConfig(**common)
    if family == "llama-128":  # the Triton path's tiny Llama: 64-wide K tiles in every GEMM, 32-wide heads; one
        # layer, since the interpreter runs every kernel program in Python
        return LlamaConfig(**{**common, "hidden_size": 128, "intermediate_size": 256, "head_dim": 32,
                              "num_hidden_layers": 1})
    if family == "qwen2":
        return Qwen2Config(**common)  # q/k/v projections carry biases
    if family == "qwen3":
        return Qwen3Config(head_dim=16, **common)  # per-head q/k RMSNorm
    raise ValueError(family)


def word_tokenizer() -> PreTrainedTokenizerFast:
    """Token i is the word '<i>': text and ids map one to one."""
    vocab = {f"<{i}>": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=f"<{EOS}>")


def byte_level_bpe(texts: list[str], vocab_size: int, eos: str) -> PreTrainedTokenizerFast:
    """A tiny byte-level BPE trained here on texts, eos its one special token: multi-byte characters span tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[eos],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, clean_up_tokenization_spaces=False)


def build_tiny(family: str, root: str, seed: int = 0) -> str:
    """Save a tiny random model of `family` with a word tokenizer under root; returns its folder."""
    path = os.path.join(root, f"tiny-{family}-{seed}")
    if os.path.isdir(path):
        return path
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(family)).eval()
    if family == "qwen2":  # random biases, so a wrong bias path shows up
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    model.save_pretrained(path, safe_serialization=True)
    word_tokenizer().save_pretrained(path)
    return path


_HF_CACHE: dict[str, torch.nn.Module] = {}


def hf_model(path: str):
    if path not in _HF_CACHE:
        _HF_CACHE[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return _HF_CACHE[path]


def hf_greedy(path: str, prompt_ids: list[int], max_new_tokens: int, eos: int | list[int] | None = None, **kw) -> list[int]:
    """transformers' own greedy generate; it stops at token `eos` if given, else runs the full length."""
    model = hf_model(path)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=eos, pad_token_id=0,
                             attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long), **kw)
    return out[0, len(prompt_ids):].tolist()


def random_prompts(lengths, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, VOCAB - 2, (n,), generator=g).tolist() for n in lengths]


def kv_blocks_used_after_settling(engine, timeout_s: float = 5.0) -> int:
    """KV blocks still held once the loop has read its last step (blocks of a request finished while a step
    was queued return one step later), or after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while engine.stats()["kv_blocks_used"] and time.monotonic() < deadline:
        time.sleep(0.01)
    return engine.stats()["kv_blocks_used"]


def tiny_engine(path: str, async_pipeline: bool, **settings):
    """An engine on the CPU over a tiny checkpoint, in blocks of 4 tokens, 16 seats; settings override."""
    from backend import Engine, EngineConfig

    config = dict(model=path, device="cpu", block_size=4, max_num_seqs=16, async_pipeline=async_pipeline)
    return Engine(EngineConfig(**{**config, **settings}))
