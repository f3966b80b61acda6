"""python -m bench.offline: the offline benchmark, our engine beside transformers on the same prompts.

Prints its settings, a table, and one JSON line of results. Workloads: WORKLOADS below; current figures in
docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import gc
import queue
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field, replace

import torch

from backend import Engine, EngineConfig, SamplingParams
from backend.models import STAND_IN
from bench.kernel_busy import run_with_kernel_busy
from bench.traffic import TrafficMix

COPY_BANDWIDTH = 4.24e12  # bytes/s of an H200 device-to-device copy, bytes read + written (docs/benchmarks.md)


@dataclass
class Workload:
    """One benchmark's model, prompts and lengths."""

    model: str
    requests: list[int]  # concurrent request counts to run (one run each)
    prompt_len: tuple[int, int]  # min, max prompt tokens
    new_tokens: int
    device: str = "cuda"
    engine: dict = field(default_factory=dict)
    length_spread: int = 0  # request i asks for new_tokens - (i * 7919) % (length_spread + 1): finishes spread out
    traffic: TrafficMix | None = None  # a realistic mix instead: lengths drawn per request (requests ignored)

    def max_tokens(self, i: int) -> int:
        return self.new_tokens - (i * 7919) % (self.length_spread + 1)


WORKLOADS = {
    "cpu-tiny": Workload("random:tiny", [8], (16, 64), 64, device="cpu",
                         engine=dict(num_kv_blocks=512, max_num_seqs=8, max_num_batched_tokens=256)),
    "cpu-overhead": Workload(STAND_IN, [64, 256], (128, 128), 512, device="cpu",
                             engine=dict(num_kv_blocks=256 * 41, max_num_seqs=256, max_num_batched_tokens=4096)),
    "cpu-churn": Workload(STAND_IN, [64, 256], (128, 128), 512, device="cpu", length_spread=384,
                          engine=dict(num_kv_blocks=256 * 41, max_num_seqs=256, max_num_batched_tokens=4096)),
    "cpu-queue": Workload(STAND_IN, [512], (128, 128), 512, device="cpu", length_spread=384,
                          engine=dict(num_kv_blocks=256 * 41, max_num_seqs=256, max_num_batched_tokens=4096)),
    "blog-quick": Workload("random:llama-3-8b", [32], (128, 128), 2048,
                           engine=dict(max_num_seqs=32, max_num_batched_tokens=4096)),
    "blog": Workload("random:llama-3-8b", [32], (128, 128), 8192,
                     engine=dict(max_num_seqs=32, max_num_batched_tokens=4096)),
    # the seed article's sweet spot: long generations (RL rollouts), on the long-context config
    "blog-16k": Workload("random:llama-3.1-8b", [32], (128, 128), 16384,
                         engine=dict(max_num_seqs=32, max_num_batched_tokens=4096)),
    # prefill: 32 prompts of 2,048 tokens and one new token each (prompt tokens/s is what it measures)
    "prefill-8b": Workload("random:llama-3-8b", [32], (2048, 2048), 1,
                           engine=dict(max_num_seqs=32, max_num_batched_tokens=8192)),
    # the 70B shape, which fits one H200 only with FP8 weights (--set quantization=fp8)
    "blog-70b": Workload("random:llama-3-70b", [32], (128, 128), 2048,
                         engine=dict(max_num_seqs=32, max_num_batched_tokens=4096)),
    "small-64": Workload("random:llama-3.2-1b", [64], (128, 128), 1024,
                         engine=dict(max_num_seqs=64, max_num_batched_tokens=8192)),
    "small-many": Workload("random:llama-3.2-1b", [128, 256], (128, 128), 512,
                           engine=dict(max_num_seqs=256, max_num_batched_tokens=8192)),
    # realistic mixes (bench/traffic.py): log-normal prompt and output lengths, all requests queued at once. Up to
    # 1,024 running requests, vLLM's default on GPUs of 70 GiB and more: with 256, the queue drains in more waves
    # and the last long outputs run in near-empty steps (docs/benchmarks.md compares the two)
    "mix-8b": Workload("random:llama-3-8b", [1000], (4, 2048), 1024, traffic=TrafficMix(1000),
                       engine=dict(max_num_seqs=1024, max_num_batched_tokens=8192)),
    "mix-1b": Workload("random:llama-3.2-1b", [2000], (4, 2048), 1024, traffic=TrafficMix(2000),
                       engine=dict(max_num_seqs=1024, max_num_batched_tokens=8192)),
    "mix-1b-chat": Workload("random:llama-3.2-1b", [2000], (4, 2048), 1024, traffic=TrafficMix(2000, chat=True),
                            engine=dict(max_num_seqs=1024, max_num_batched_tokens=8192)),
    # mix-1b's requests on the stand-in model, at most 256 running: the engine's own CPU per step on that traffic
    "cpu-mix-2000": Workload(STAND_IN, [2000], (4, 2048), 1024, device="cpu", traffic=TrafficMix(2000),
                             engine=dict(num_kv_blocks=256 * 200, max_num_seqs=256, max_num_batched_tokens=8192)),
    "cpu-mix": Workload(STAND_IN, [256], (4, 2048), 1024, device="cpu", traffic=TrafficMix(256, chat=True),
                        engine=dict(num_kv_blocks=256 * 240, max_num_seqs=256, max_num_batched_tokens=4096)),
}


def synthetic_params(max_tokens: int, decoding: str, seed: int) -> SamplingParams:
    """A synthetic workload's request: greedy, or sampled with T 0.8, top-p 0.95 and top-k 50 (seeded); EOS ignored,
    so it decodes max_tokens either way."""
    if decoding == "greedy":
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    if decoding == "sampled":
        return SamplingParams(max_tokens=max_tokens, temperature=0.8, top_p=0.95, top_k=50, seed=seed,
                              ignore_eos=True)
    raise ValueError(f"decoding must be 'greedy' or 'sampled', got {decoding!r}")


def make_prompts(n: int, lengths: tuple[int, int], vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, min(vocab, 250)) for _ in range(rng.randint(*lengths))] for _ in range(n)]


def build_engine(wl: Workload, async_pipeline: bool, args) -> Engine:
    max_len = wl.traffic.max_model_len if wl.traffic else wl.prompt_len[1] + wl.new_tokens
    settings = dict(model=wl.model, device=args.device or wl.device, async_pipeline=async_pipeline,
                    max_model_len=max_len + 16, timeline=True)
    settings.update(wl.engine)
    if args.attention:
        settings["attention_backend"] = args.attention
    if args.set:  # engine settings as config.pbtxt would give them, e.g. loop_gate=false
        given = dict(item.split("=", 1) for item in args.set)
        parsed = EngineConfig.from_dict(given)
        settings.update({k: getattr(parsed, k) for k in given})
    if wl.model == STAND_IN:
        torch.set_num_threads(1)  # why: the stand-in's tiny CPU ops only pay thread start-up with more
    return Engine(EngineConfig(**settings))


# the JSON schema --structured-share gives requests: open-ended (notes of any count), so a row's length is the model's
# choice within max_tokens, as an unconstrained row's is
NOTES_SCHEMA = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 24},
                                                 "notes": {"type": "array", "items": {"type": "string"}}},
                "required": ["title", "notes"]}


def constrain(params: list[SamplingParams], share: float) -> list[SamplingParams]:
    """The first share of the requests (by count) follow NOTES_SCHEMA (structured outputs); the rest unchanged."""
    k = round(len(params) * share)
    return [replace(p, structured_outputs={"json": NOTES_SCHEMA}) if i < k else p for i, p in enumerate(params)]


def run_engine(wl: Workload, n: int, async_pipeline: bool, args, decoding: str = "greedy") -> dict:
    engine = build_engine(wl, async_pipeline, args)
    try:
        vocab = engine.spec.vocab_size
        engine.generate(make_prompts(min(n, 4), (16, 16), vocab, seed=99), SamplingParams(max_tokens=4,
                                                                                          ignore_eos=True))
        if wl.traffic is not None:
            prompts, params = wl.traffic.build(vocab, decoding)
        else:
            params = [synthetic_params(wl.max_tokens(i), decoding, seed=i) for i in range(n)]
            prompts = make_prompts(n, wl.prompt_len, vocab)
        if args.structured_share:
            params = constrain(params, args.structured_share)
        hits_before = engine.stats()["prefix_cache_hits"], engine.stats()["prefix_cache_queries"]
        spec_before = engine.speculator.counts() if engine.speculator is not None else None
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        engine.timeline.copy_spans = bool(args.timeline)  # the picture shows the copy streams; busy never counts them
        engine.set_timeline(True)
        run = lambda: stream_all(engine, prompts, params) if args.stream else engine.generate(prompts, params)  # noqa: E731
        kernel_busy, kernels = None, []
        if (args.kernel_busy or args.kernel_top) and engine.device.type == "cuda":
            outs, wall, kernel_busy, kernels = run_with_kernel_busy(run, args.kernel_top)
        else:
            start = time.perf_counter()
            outs = run()
            wall = time.perf_counter() - start
        engine.set_timeline(False)
        time.sleep(0.05)  # the loop applies the switch at its next step
        tokens = sum(len(o.token_ids) for o in outs)
        summary = engine.timeline.summary()
        result = dict(mode="async" if async_pipeline else "sync", requests=len(prompts), wall_s=round(wall, 3),
                      tok_per_s=round(tokens / wall, 1), output_tokens=tokens,
                      prompt_tok_per_s=round(sum(map(len, prompts)) / wall, 1),
                      gpu_busy=round(summary["gpu_busy_fraction"], 4),
                      cpu_us_per_step=round(summary["cpu_us_per_step"], 1), steps=summary["steps"],
                      preemptions=engine.stats()["preemptions"], cpu_us_by_phase=summary["cpu_us_by_phase"])
        if summary["gpu_busy_uncertain_fraction"] > 0.02:  # eager spans that may hold launch gaps, beside gpu_busy
            result["gpu_busy_uncertain"] = round(summary["gpu_busy_uncertain_fraction"], 4)
        if kernel_busy is not None:  # the same run under torch.profiler: its kernel union over the wall time
            result["gpu_kernel_busy"] = round(kernel_busy, 4)
        for k in kernels:
            print(f"kernel  {k['ms']:10.2f} ms  {k['share']:6.1%}  {k['calls']:7d} calls  {k['name']}", flush=True)
        if wl.traffic is None and decoding != "greedy":
            result["decoding"] = decoding
        if args.structured_share:
            result["structured_share"] = args.structured_share
        if spec_before is not None:  # --set speculative_method=...: what the drafts gave in this run
            result["speculation"] = speculation_counts(spec_before, engine.speculator.counts())
        if wl.traffic is not None:
            stats = engine.stats()
            queries = stats["prefix_cache_queries"] - hits_before[1]
            result.update(decoding=decoding, requests_per_s=round(len(prompts) / wall, 2),
                          total_tok_per_s=round((tokens + sum(map(len, prompts))) / wall, 1),
                          prefix_hit_rate=round((stats["prefix_cache_hits"] - hits_before[0]) / queries, 3)
                          if queries else 0.0)
        elif wl.model == STAND_IN and decoding == "greedy":
            from backend.models.standin import expected_tokens

            result["all_tokens_exact"] = all(o.token_ids == expected_tokens(p, wl.max_tokens(i), vocab)
                                             for i, (o, p) in enumerate(zip(outs, prompts)))
        if engine.device.type == "cuda":
            result["peak_mem_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 2)
            if wl.traffic is None:  # every request decodes new_tokens: the roofline's premise
                result["roofline"] = round(roofline_seconds(engine, prompts, wl.new_tokens) / wall, 3)
        if args.timeline:
            stem = f"{args.timeline}-{result['mode']}-{n}"
            engine.timeline.png(stem + ".png", title=f"{args.workload} {result['mode']} ({n} requests)")
            engine.timeline.chrome_trace(stem + ".json")
        return result
    finally:
        engine.shutdown()
        del engine
        gc.collect()  # why: the next run sizes its KV cache from free memory; this one's must be gone
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def speculation_counts(before: dict, after: dict) -> dict:
    """Drafted spans, draft tokens, accepted tokens and the mean acceptance length between two counts."""
    drafts, proposed, accepted = (after[k] - before[k] for k in ("spec_drafts", "spec_proposed_tokens",
                                                                 "spec_accepted_tokens"))
    return dict(drafts=drafts, draft_tokens=proposed, accepted_tokens=accepted,
                mean_acceptance_length=round(1 + accepted / drafts, 3) if drafts else None)


def stream_all(engine: Engine, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list:
    """Like generate(), but every request streams an output per step into one queue, as a server's sender
    thread would consume them: the output thread detokenizes every step, beside the engine loop."""
    sink: queue.SimpleQueue = queue.SimpleQueue()
    ids = [f"stream-{i}" for i in range(len(prompts))]
    plist = params if isinstance(params, list) else [params] * len(prompts)
    for rid, prompt, p in zip(ids, prompts, plist):
        engine.add_request(prompt, p, request_id=rid, sink=sink)
    finals: dict = {}
    while len(finals) < len(ids):
        out = sink.get()
        if out.finished:
            finals[out.request_id] = out
    return [finals[rid] for rid in ids]


def roofline_seconds(engine: Engine, prompts: list[list[int]], new_tokens: int) -> float:
    """Bytes every decode step must read (all weights + each request's KV so far, at the cache's element size: an
    FP8 cache reads half the bytes of a bf16 one) over copy bandwidth."""
    weights = sum(p.numel() * p.element_size() for p in engine.parts.model.parameters())
    kv_per_token = engine.spec.kv_bytes_per_block(1, engine.parts.kv_cache_dtype)
    total = 0.0
    for t in range(new_tokens):
        context = sum(len(p) + t for p in prompts)
        total += weights + context * kv_per_token
    return total / COPY_BANDWIDTH


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--workload", default="cpu-tiny", choices=sorted(WORKLOADS) + ["microbench"])
    ap.add_argument("--compare", default="", help="'transformers' to run transformers on the same prompts")
    ap.add_argument("--modes", default="sync,async", help="our engine's modes to run")
    ap.add_argument("--device", default=None)
    ap.add_argument("--attention", default=None, choices=["torch", "triton"])
    ap.add_argument("--timeline", default=None, help="file stem for timeline PNG + Chrome trace per run")
    ap.add_argument("--new-tokens", type=int, default=None, help="override the workload's new tokens")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="an engine setting for our runs (as in config.pbtxt), e.g. --set loop_gate=false")
    ap.add_argument("--requests", default=None, help="override concurrent requests, e.g. 64 or 64,256")
    ap.add_argument("--stream", action="store_true",
                    help="stream every request's outputs (detokenized each step, as when serving) instead of "
                         "generate()'s final-only outputs")
    ap.add_argument("--profile", action="store_true", help="cProfile the engine thread; print the top functions")
    ap.add_argument("--profile-sort", default="tottime", choices=["tottime", "cumulative"],
                    help="with --profile: order the functions by their own time or by the time under them")
    ap.add_argument("--profile-top", type=int, default=22, metavar="N", help="with --profile: how many functions")
    ap.add_argument("--kernel-busy", action="store_true",
                    help="CUDA: run under torch.profiler and report its kernel time over the wall (gpu_kernel_busy)")
    ap.add_argument("--kernel-top", type=int, default=0, metavar="N",
                    help="CUDA: as --kernel-busy, and print the N kernels that took the most GPU time")
    ap.add_argument("--decoding", default=None,
                    help="greedy, sampled or both (greedy,sampled). Mix workloads sample with T 0.7-0.8 and top-p 0.95 "
                         "and run both unless told; synthetic ones sample with T 0.8, top-p 0.95 and top-k 50 and "
                         "run greedy unless told. Sampled requests are seeded")
    ap.add_argument("--structured-share", type=float, default=0.0, metavar="S",
                    help="this share of the requests (0-1) follow a JSON schema (structured outputs)")
    ap.add_argument("--compare-new-tokens", type=int, default=None,
                    help="new tokens for the transformers runs (default: the workload's); tok/s is quoted")
    args = ap.parse_args(argv)
    if args.workload == "microbench":
        from bench import microbench

        return microbench.main([])
    wl = WORKLOADS[args.workload]
    if args.profile:
        _profile_engine_thread(args.profile_sort, args.profile_top)
    if args.new_tokens:
        wl.new_tokens = args.new_tokens
    if args.requests:
        wl.requests = [int(x) for x in args.requests.split(",")]
    print(f"# workload {args.workload}: model {wl.model}, requests {wl.requests}, prompt {wl.prompt_len}, "
          f"new tokens {wl.new_tokens}, device {args.device or wl.device}, torch {torch.__version__}", flush=True)
    rows = []
    if wl.traffic is not None and args.requests:
        wl.traffic = replace(wl.traffic, num_requests=wl.requests[0])
    decodings = (args.decoding or ("greedy,sampled" if wl.traffic is not None else "greedy")).split(",")
    for n in wl.requests:
        for decoding in decodings:
            for mode in args.modes.split(","):
                rows.append(dict(engine="tandem", **run_engine(wl, n, mode == "async", args, decoding)))
                print(_row(rows[-1]), flush=True)
        if args.compare == "transformers":
            from bench.transformers_baseline import run_transformers

            hf_wl = Workload(wl.model, wl.requests, wl.prompt_len, args.compare_new_tokens or wl.new_tokens)
            for r in run_transformers(hf_wl, n, make_prompts(n, wl.prompt_len, 250), args.device or wl.device):
                r["new_tokens"] = hf_wl.new_tokens
                rows.append(dict(engine="transformers", requests=n, **r))
                print(_row(rows[-1]), flush=True)
    out = dict(workload=args.workload, model=wl.model, new_tokens=wl.new_tokens, runs=rows)
    if args.workload in ("cpu-overhead", "cpu-churn", "cpu-queue"):
        for n in wl.requests:
            cpu = [r["cpu_us_per_step"] for r in rows if r["requests"] == n and r.get("mode") == "async"]
            if cpu:
                out[f"cpu_us_per_step_{n}"] = statistics.median(cpu)
    print(json.dumps(out))
    return 0


def _profile_engine_thread(sort: str, top: int) -> None:
    """Wrap the engine loop in cProfile; the top functions are printed when each engine stops."""
    import cProfile
    import pstats

    from backend.engine_loop import EngineLoop

    original = EngineLoop.run

    def run(self):
        prof = cProfile.Profile()
        prof.enable()
        try:
            original(self)
        finally:
            prof.disable()
            pstats.Stats(prof, stream=sys.stdout).sort_stats(sort).print_stats(top)

    EngineLoop.run = run


def _row(r: dict) -> str:
    keys = ["engine", "mode", "decoding", "structured_share", "requests", "wall_s", "requests_per_s", "tok_per_s", "prompt_tok_per_s",
            "total_tok_per_s",
            "prefix_hit_rate", "gpu_busy", "gpu_busy_uncertain", "gpu_kernel_busy", "cpu_us_per_step", "roofline",
            "peak_mem_gb", "steps", "preemptions", "all_tokens_exact", "speculation", "cpu_us_by_phase"]
    return "  ".join(f"{k}={r[k]}" for k in keys if k in r)


if __name__ == "__main__":
    sys.exit(main())
