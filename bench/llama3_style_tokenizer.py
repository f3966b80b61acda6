"""A tokenizer made like Llama 3's, for benchmarks and tests that need one offline: byte-level BPE under Llama 3's
pre-tokenizer pattern, its learned tokens followed by Llama 3.1's 256 special tokens in their order (with 128,000
learned tokens, at Llama 3's ids: 128,000 <|begin_of_text|>, 128,009 <|eot_id|>, ...). Its merges are learned from
the Python installation's own source and text files, not Meta's: it stands for the size and make of a Llama 3
vocabulary, which is what a grammar library's token masks cost. 128,000 tokens learn in about 25 s from 120 MB;
`load` keeps them under ~/.cache/tandem."""
from __future__ import annotations

import os
import shutil
import sysconfig
from pathlib import Path

LLAMA3_LEARNED = 128_000  # Llama 3's regular tokens; its special tokens follow at 128,000-128,255
LLAMA3_CORPUS_BYTES = 120_000_000  # enough text for 128,000 merges seen at least twice
# Llama 3's pre-tokenizer: contractions, words with one leading non-letter, numbers of up to three digits,
# punctuation runs, newlines, spaces
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_NAMED = {0: "<|begin_of_text|>", 1: "<|end_of_text|>", 4: "<|finetune_right_pad_id|>", 6: "<|start_header_id|>",
          7: "<|end_header_id|>", 8: "<|eom_id|>", 9: "<|eot_id|>", 10: "<|python_tag|>"}


def special_tokens() -> list[str]:
    """Llama 3.1's 256 special tokens in id order: the named ones, and reserved ones numbered in between."""
    out, reserved = [], 0
    for offset in range(256):
        if offset in _NAMED:
            out.append(_NAMED[offset])
        else:
            out.append(f"<|reserved_special_token_{reserved}|>")
            reserved += 1
    return out


def corpus_files(max_bytes: int) -> list[str]:
    """Text to learn merges from, in a fixed order: the standard library's Python sources, then the installed
    packages' sources and documents (tests left out), up to max_bytes in all."""
    stdlib, packages = Path(sysconfig.get_paths()["stdlib"]), Path(sysconfig.get_paths()["purelib"])
    found = sorted(p for p in stdlib.rglob("*.py") if "test" not in p.parts and "site-packages" not in p.parts)
    found += sorted(p for ext in ("*.py", "*.md", "*.txt", "*.rst") for p in packages.rglob(ext)
                    if "test" not in str(p.relative_to(packages)))
    files, total = [], 0
    for path in found:
        size = path.stat().st_size
        if total + size <= max_bytes:
            files.append(str(path))
            total += size
    return files


def build(learned: int = LLAMA3_LEARNED, corpus_bytes: int = LLAMA3_CORPUS_BYTES):
    """A PreTrainedTokenizerFast with `learned` BPE tokens (fewer if the text holds fewer merges) and Llama 3's
    special tokens after them; BOS <|begin_of_text|>, EOS <|eot_id|> (an instruct model's end of turn)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=learned, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train(corpus_files(corpus_bytes), trainer)
    tok.add_special_tokens(special_tokens())
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")


def load(learned: int = LLAMA3_LEARNED, corpus_bytes: int = LLAMA3_CORPUS_BYTES, cache_dir: str | None = None):
    """build's tokenizer, learned once and then read from the cache folder."""
    from transformers import AutoTokenizer

    root = Path(cache_dir or os.environ.get("TANDEM_CACHE_DIR") or Path.home() / ".cache" / "tandem")
    folder = root / f"llama-3-style-tokenizer-{learned}-from-{corpus_bytes}-bytes"
    if not (folder / "tokenizer.json").is_file():
        staging = folder.with_name(folder.name + f".tmp{os.getpid()}")  # the cache holds a whole folder or none
        build(learned, corpus_bytes).save_pretrained(staging)
        if folder.exists():  # another process was quicker
            shutil.rmtree(staging)
        else:
            os.replace(staging, folder)
    return AutoTokenizer.from_pretrained(folder)
