"""python -m bench.step_profile: where a decode step's GPU time goes, kernel by kernel (CUDA only).

Runs one batch of greedy requests through the engine under torch.profiler (CUPTI sees the kernels inside the
replayed CUDA graphs) and prints, per kernel name, calls per step and µs per step, then one JSON line.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from backend import Engine, EngineConfig, SamplingParams
from bench.offline import make_prompts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="random:llama-3-8b")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="engine setting")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("step_profile needs a CUDA device")
    settings = dict(model=args.model, max_num_seqs=args.requests, max_num_batched_tokens=4096,
                    max_model_len=args.prompt_len + args.new_tokens + 16)
    settings.update(dict(item.split("=", 1) for item in args.set))
    engine = Engine(EngineConfig.from_dict({k: str(v) for k, v in settings.items()}))
    try:
        prompts = make_prompts(args.requests, (args.prompt_len, args.prompt_len), engine.spec.vocab_size)
        params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
        engine.generate(prompts[:4], SamplingParams(max_tokens=4, ignore_eos=True))  # compile and capture first
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            engine.generate(prompts, params)
            wall = time.perf_counter() - start
    finally:
        engine.shutdown()
    steps = args.new_tokens
    kernels = [e for e in prof.key_averages() if e.device_time_total > 0]
    kernels.sort(key=lambda e: e.device_time_total, reverse=True)
    total_us = sum(e.device_time_total for e in kernels)
    print(f"wall {wall:.3f} s, {wall / steps * 1e6:.1f} µs per step; kernels {total_us / steps:.1f} µs per step "
          f"({len(kernels)} names, {sum(e.count for e in kernels) / steps:.1f} launches per step)")
    rows = []
    for e in kernels[: args.top]:
        rows.append(dict(name=e.key[:90], calls_per_step=round(e.count / steps, 2),
                         us_per_step=round(e.device_time_total / steps, 1),
                         us_per_call=round(e.device_time_total / max(e.count, 1), 2)))
        print(f"  {rows[-1]['us_per_step']:8.1f} µs/step {rows[-1]['calls_per_step']:7.2f} calls "
              f"{rows[-1]['us_per_call']:8.2f} µs/call  {rows[-1]['name']}")
    print(json.dumps(dict(wall_s=round(wall, 3), steps=steps, kernel_us_per_step=round(total_us / steps, 1),
                          launches_per_step=round(sum(e.count for e in kernels) / steps, 1), top=rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
