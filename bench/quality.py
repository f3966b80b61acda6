"""python -m bench.quality: what FP8 costs the default model in quality, in four configurations of the engine:
the baseline dtype (bf16), FP8 weights (quantization=fp8), FP8 weights + an FP8 KV cache (kv_cache_dtype=fp8), and
FP8 weights whose linears also round their inputs to e4m3 per token, as the GPU's FP8 x FP8 GEMMs do for prefill
and steps of more than 64 rows (the torch ops, wrapped here: the engine itself has no such setting).

- perplexity: teacher-forced over bench/data/quality_text.txt in non-overlapping windows, each a sequence of a
  prefill through the engine's model (its own forward, over a paged KV cache of the engine's cache dtype);
- greedy agreement: the engine's greedy outputs for bench/data/quality_prompts.txt (each a chat user message)
  against the baseline's: the share of prompts whose whole output is the same, and the mean share of tokens before
  the first difference.
On the CPU the torch ops dequantize FP8 weights and cache values before using them, so FP8 is emulated exactly as
quantize -> dequantize. Prints its settings, a table, and one JSON line of results.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from backend import Engine, EngineConfig, SamplingParams
from backend.models import DEFAULT_ALIAS, resolve_model_path
from backend.executor.step_ops import StepOps
from backend.models.loader import TORCH_DTYPES
from backend.ops import Ops, fp8
from bench.perplexity import BLOCK_SIZE, perplexity

DATA = Path(__file__).parent / "data"
TEXT = DATA / "quality_text.txt"
PROMPTS = DATA / "quality_prompts.txt"
# name -> the engine settings that make it; the first is the baseline the others are compared with
CONFIGS = {
    "baseline": dict(quantization="none", kv_cache_dtype="auto"),
    "fp8_weights": dict(quantization="fp8", kv_cache_dtype="auto"),
    "fp8_weights_kv": dict(quantization="fp8", kv_cache_dtype="fp8"),
    "fp8_weights_activations": dict(quantization="fp8", kv_cache_dtype="auto", fp8_activations=True),
}


def round_rows_to_fp8(x: torch.Tensor) -> torch.Tensor:
    """x with each row (token) rounded to e4m3 under its own scale (its largest magnitude maps to 448), back in x's
    dtype: the dynamic per-token activation quantization of the FP8 x FP8 GEMMs."""
    rows = x.reshape(-1, x.shape[-1])
    q, scale = fp8.quantize_per_channel(rows)
    return fp8.dequantize(q, scale, x.dtype).reshape(x.shape)


def with_fp8_activations(ops: Ops) -> Ops:
    """ops whose linears with FP8 weights (a scale given) take their input rounded per token to e4m3."""
    def linear(x, weight, bias=None, out=None, *, scale=None):
        return ops.linear(round_rows_to_fp8(x) if scale is not None else x, weight, bias, out, scale=scale)

    def linear_parked(x, weight, bias=None, *, scale=None):
        return ops.linear_parked(round_rows_to_fp8(x) if scale is not None else x, weight, bias, scale=scale)

    def linear_silu_and_mul(x, weight, bias=None, *, scale=None):
        return ops.linear_silu_and_mul(round_rows_to_fp8(x) if scale is not None else x, weight, bias, scale=scale)

    return dataclasses.replace(ops, linear=linear, linear_parked=linear_parked,
                               linear_silu_and_mul=linear_silu_and_mul)


def load_prompts(n: int | None = None) -> list[str]:
    """The prompts; n of them, evenly spread, when given (questions, instructions and continuations alike)."""
    lines = [line.strip() for line in PROMPTS.read_text().splitlines() if line.strip()]
    return [lines[i * len(lines) // n] for i in range(n)] if n and n < len(lines) else lines


def text_windows(tokenizer, window: int, count: int | None = None) -> list[list[int]]:
    """The text's tokens in consecutive windows; `count` of them, evenly spread over the text, when given."""
    ids = tokenizer.encode(TEXT.read_text(), add_special_tokens=False)
    windows = [ids[i:i + window] for i in range(0, len(ids), window)]
    if count and count < len(windows):
        # full windows, spread out: the text's parts differ in how well the model knows them
        full = [w for w in windows if len(w) == window]
        windows = [full[round(i * (len(full) - 1) / max(count - 1, 1))] for i in range(min(count, len(full)))]
    return windows


def chat_prompts(tokenizer, prompts: list[str]) -> list[list[int]]:
    """Each prompt as the instruct model is asked: a user message in its chat template, ready for its answer."""
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                           add_generation_prompt=True) for p in prompts]
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


def run_config(dtype_name: str, device: str, settings: dict, windows: list[list[int]],
               prompt_ids: list[list[int]], max_tokens: int) -> tuple[dict, list[list[int]]]:
    """One engine in this configuration: the perplexity of its model over the windows (with a KV cache of the
    engine's cache dtype), then its greedy tokens for each prompt, all prompts at once (room for all: no
    preemption)."""
    blocks = sum(-(-(len(p) + max_tokens) // BLOCK_SIZE) for p in prompt_ids)
    settings = dict(settings)
    fp8_activations = settings.pop("fp8_activations", False)
    engine = Engine(EngineConfig(model=DEFAULT_ALIAS, device=device, dtype=dtype_name, block_size=BLOCK_SIZE,
                                 num_kv_blocks=blocks, max_num_seqs=len(prompt_ids), **settings))
    if fp8_activations:  # the perplexity's forwards (the model's own ops) and the engine's steps
        model, runner = engine.parts.model, engine.parts.runner
        model.ops = with_fp8_activations(model.ops)
        steps = runner.step_ops
        runner.step_ops = StepOps(with_fp8_activations(steps.dependent), with_fp8_activations(steps.plain),
                                  steps.max_dependent_rows)
    try:
        ppl = perplexity(engine.parts.model, windows, engine.parts.kv_cache_dtype)
        outs = engine.generate(prompt_ids, SamplingParams(max_tokens=max_tokens, temperature=0))
    finally:
        engine.shutdown()
    return ppl, [list(o.token_ids) for o in outs]


def agreement(reference: list[list[int]], outputs: list[list[int]]) -> dict:
    """exact: share of prompts with the reference's whole output; prefix: mean share of tokens before the first
    difference, over the longer of the two outputs (1.0 when they are equal)."""
    exact, prefix = [], []
    for ref, out in zip(reference, outputs, strict=True):
        same = next((i for i, (a, b) in enumerate(zip(ref, out)) if a != b), min(len(ref), len(out)))
        exact.append(ref == out)
        prefix.append(same / max(len(ref), len(out), 1))
    return dict(exact=statistics.fmean(exact), prefix=statistics.fmean(prefix))


def measure(dtype_name: str = "bfloat16", device: str = "cpu", window: int = 512, num_windows: int | None = None,
            num_prompts: int | None = None, max_tokens: int = 32, configs: dict = CONFIGS, log=print) -> dict:
    """Every configuration's perplexity and greedy agreement with the first one's outputs -> {name: figures}."""
    from transformers import AutoTokenizer  # heavy import, only when measuring

    path = resolve_model_path(DEFAULT_ALIAS)
    tokenizer = AutoTokenizer.from_pretrained(path)
    windows = text_windows(tokenizer, window, num_windows)
    prompt_ids = chat_prompts(tokenizer, load_prompts(num_prompts))
    results, reference = {}, None
    for name, settings in configs.items():
        start = time.perf_counter()
        ppl, outputs = run_config(dtype_name, device, settings, windows, prompt_ids, max_tokens)
        reference = reference or outputs
        base = next(iter(results.values()), None)
        row = dict(settings, perplexity=ppl["perplexity"], tokens=ppl["tokens"],
                   perplexity_delta=ppl["perplexity"] / base["perplexity"] - 1 if base else 0.0,
                   **{f"greedy_{k}": v for k, v in agreement(reference, outputs).items()},
                   seconds=round(time.perf_counter() - start, 1))
        results[name] = row
        log(_row(name, row))
    return results


def _row(name: str, r: dict) -> str:
    return (f"{name:15s} perplexity {r['perplexity']:8.4f} ({r['perplexity_delta']:+7.2%})  greedy exact "
            f"{r['greedy_exact']:6.1%}  prefix {r['greedy_prefix']:6.1%}  ({r['seconds']:.0f} s)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(TORCH_DTYPES), help="the baseline's dtype")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--window", type=int, default=512, help="tokens per perplexity window")
    ap.add_argument("--windows", type=int, default=None, help="only N windows, evenly spread over the text "
                                                              "(default: all)")
    ap.add_argument("--prompts", type=int, default=None, help="only N prompts, evenly spread (default: all 200)")
    ap.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per prompt")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="which configurations, the baseline first")
    args = ap.parse_args(argv)
    configs = {name: CONFIGS[name] for name in args.configs.split(",")}
    print(f"# quality: model {DEFAULT_ALIAS}, dtype {args.dtype}, device {args.device}, text {TEXT.name} "
          f"({args.windows or 'all'} windows of {args.window} tokens), prompts {PROMPTS.name} "
          f"({args.prompts or 'all'}), greedy max_tokens {args.max_tokens}, torch {torch.__version__}, "
          f"threads {torch.get_num_threads()}", flush=True)
    results = measure(args.dtype, args.device, args.window, args.windows, args.prompts, args.max_tokens, configs,
                      log=lambda line: print(line, flush=True))
    print(json.dumps(dict(model=DEFAULT_ALIAS, dtype=args.dtype, device=args.device, window=args.window,
                          max_tokens=args.max_tokens, prompts=len(load_prompts(args.prompts)), configs=results)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
