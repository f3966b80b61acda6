"""GPU time of one sampling step: the fused Triton kernel against the torch sampler, both replayed from a CUDA graph.

`python -m bench.sampler_bench` times rows of a Llama-3 vocabulary (128,256) in bf16 at a few batch sizes, for
plain temperature, top-p 0.95, top-k 50 and both; prints one line per case and one JSON line.
"""
from __future__ import annotations

import argparse
import functools
import json

import torch

from bench.microbench import _require_cuda, _time_graph
from backend.executor.sampler import Sampler, SampleTargets, SamplingTensors

CASES = {"temperature": dict(top_k=0, top_p=1.0), "top_p": dict(top_k=0, top_p=0.95),
         "top_k": dict(top_k=50, top_p=1.0), "top_k_top_p": dict(top_k=50, top_p=0.95)}


def _tensors(rows: int, top_k: int, top_p: float) -> SamplingTensors:
    def full(v, dtype):
        return torch.full((rows,), v, dtype=dtype, device="cuda")

    return SamplingTensors(
        temperature=full(0.8, torch.float32), top_k=full(top_k, torch.int32), top_p=full(top_p, torch.float32),
        min_p=full(0.0, torch.float32), repetition_penalty=full(1.0, torch.float32),
        presence_penalty=full(0.0, torch.float32), frequency_penalty=full(0.0, torch.float32),
        seeds=torch.arange(rows, dtype=torch.int64, device="cuda"), step_index=full(3, torch.int64),
        prompt_token_ids=None, output_token_ids=None, all_greedy=False, any_top_k=top_k > 0, any_top_p=top_p < 1,
        any_min_p=False, any_penalty=False, num_logprobs=-1, max_top_k=top_k)


def time_case(rows: int, vocab: int, top_k: int, top_p: float, top_k_chunk: int | None = None) -> dict:
    from backend.ops.triton.sampling import sample_rows

    logits = (torch.randn(rows, vocab, device="cuda") * 2).to(torch.bfloat16)  # (B, V)
    st = _tensors(rows, top_k, top_p)
    targets = SampleTargets(*(torch.empty(rows, dtype=d, device="cuda") for d in (torch.int64, torch.float32,
                                                                                   torch.int64)),
                            torch.empty(rows, 1, dtype=torch.int64, device="cuda"),
                            torch.empty(rows, 1, device="cuda"), torch.empty(rows, device="cuda"))
    fused, plain = Sampler(functools.partial(sample_rows, top_k_chunk=top_k_chunk)), Sampler()
    plain.vocab_hash(vocab, "cuda")
    return {"rows": rows, "fused_ms": _time_graph(lambda: fused.sample_into(logits, st, targets)),
            "torch_ms": _time_graph(lambda: plain.sample_into(logits, st, targets))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", default="1,32,256")
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--top-k-chunks", default="",
                    help="also time the top-k cases with these splits of top-k's histogram passes (e.g. 2048,4096)")
    args = ap.parse_args(argv)
    _require_cuda()
    results = {}
    for name, case in CASES.items():
        for rows in (int(r) for r in args.rows.split(",")):
            r = results[f"{name}_b{rows}"] = time_case(rows, args.vocab, **case)
            print(f"{name:12s} rows {rows:4d}: fused {r['fused_ms']:.3f} ms, torch {r['torch_ms']:.3f} ms", flush=True)
            for top_k_chunk in (int(c) for c in args.top_k_chunks.split(",") if c and case["top_k"] > 0):
                r = results[f"{name}_b{rows}_kc{top_k_chunk}"] = time_case(rows, args.vocab, **case,
                                                                           top_k_chunk=top_k_chunk)
                print(f"{name:12s} rows {rows:4d}: fused {r['fused_ms']:.3f} ms with top_k_chunk {top_k_chunk}",
                      flush=True)
    print(json.dumps(results, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
