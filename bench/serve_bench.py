"""python -m bench.serve_bench: a model served by a real tritonserver, driven by N concurrent gRPC streams,
beside the same requests run offline by the engine. Prints a table and one JSON line.

Each level sends N requests at once (one wave) over gRPC streaming with token-id prompts, and reports output
tokens/s, time to first token and inter-token latency percentiles; the offline run generates the same N
requests with `Engine.generate`, so the ratio is Triton's cost.

With --rates, the requests are instead a realistic mix (bench/traffic.py: log-normal lengths, sampled or greedy)
sent open-loop at Poisson times, one rate after another (each a request rate, or "0.9x": that share of the request
rate the engine alone reached on the same mix), with TTFT / TPOT / ITL / end-to-end mean, p50 and p99 and the
goodput under an SLO (bench/open_loop.py).
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from bench.open_loop import Slo, poisson_arrivals, run_open_loop, summarize, timed_stream
from scripts.tritonserver_env import free_ports, make_model_repository, start_server, stop_server, wait_until_ready


def make_requests(n: int, prompt_len: tuple[int, int], new_tokens: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(rng.randint(*prompt_len))] for _ in range(n)]


async def drive(url: str, prompts: list[list[int]], new_tokens: int, constrained: int = 0) -> dict:
    """One wave: every prompt streamed at once; per-request TTFT, ITL and tokens. constrained: the first that many
    requests follow NOTES_SCHEMA (structured outputs), and their ITL and the others' are also reported apart."""
    from bench.offline import NOTES_SCHEMA
    from tandem_client import AsyncClient, GenerateRequest

    client = AsyncClient(url, protocol="grpc")
    schema = {"structured_outputs": json.dumps({"json": NOTES_SCHEMA})}

    async def one(i: int, ids: list[int]):
        req = GenerateRequest(input_ids=ids, max_tokens=new_tokens, temperature=0.0, ignore_eos=True,
                              extra=schema if i < constrained else {})
        start = time.perf_counter()
        first, tokens = None, 0
        async for chunk in client.stream(req):
            n = chunk.tokens()
            if n and first is None:
                first = time.perf_counter() - start
            tokens += n
        end = time.perf_counter() - start
        itl = (end - first) / max(tokens - 1, 1) if first is not None else None
        return first, itl, end, tokens

    start = time.perf_counter()
    results = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    wall = time.perf_counter() - start
    await client.close()
    ttft = sorted(r[0] for r in results if r[0] is not None)
    itl = sorted(r[1] for r in results if r[1] is not None)
    tokens = sum(r[3] for r in results)
    out = dict(requests=len(prompts), wall_s=round(wall, 3), output_tokens=tokens,
               tok_per_s=round(tokens / wall, 1), ttft_ms=_pcts(ttft), itl_ms=_pcts(itl))
    if constrained:
        out["itl_ms_constrained"] = _pcts(sorted(r[1] for r in results[:constrained] if r[1] is not None))
        out["itl_ms_unconstrained"] = _pcts(sorted(r[1] for r in results[constrained:] if r[1] is not None))
    return out


def structured_ratios(mixed: dict, alone: dict) -> dict:
    """A mixed wave's ITL against its unconstrained requests' ITL when they ran alone (the same prompts, just
    before), and the constrained requests' ITL against the unconstrained ones' in the mixed wave (means)."""
    free, bound = mixed["itl_ms_unconstrained"].get("mean"), mixed["itl_ms_constrained"].get("mean")
    base = alone["itl_ms"].get("mean")
    return dict(itl_ms_unconstrained_alone=alone["itl_ms"],
                unconstrained_itl_vs_alone=round(free / base, 3) if free and base else None,
                constrained_itl_vs_unconstrained=round(bound / free, 3) if free and bound else None)


def _pcts(values: list[float]) -> dict:
    if not values:
        return {}
    pick = lambda q: values[min(len(values) - 1, int(q * len(values)))] * 1e3  # noqa: E731
    return {"p50": round(pick(0.5), 2), "p90": round(pick(0.9), 2), "p99": round(pick(0.99), 2),
            "mean": round(statistics.mean(values) * 1e3, 2)}


def scrape(metrics_port: int) -> dict[str, float]:
    """The server's tandem_* samples, summed over label sets (one instance here)."""
    import urllib.request

    text = urllib.request.urlopen(f"http://localhost:{metrics_port}/metrics", timeout=10).read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("tandem_"):
            name, value = line.split("{", 1)[0], float(line.rsplit(" ", 1)[1])
            values[name] = values.get(name, 0.0) + value
    return values


def server_side(before: dict[str, float], after: dict[str, float]) -> dict:
    """What the server saw during one wave: its mean inter-token gap as sent, and its GPU busy share."""
    itl = "tandem_inter_token_latency_seconds"
    count = after.get(f"{itl}_count", 0.0) - before.get(f"{itl}_count", 0.0)
    total = after.get(f"{itl}_sum", 0.0) - before.get(f"{itl}_sum", 0.0)
    return dict(server_itl_mean_ms=round(total / count * 1e3, 3) if count else None,
                server_gpu_busy=after.get("tandem_gpu_busy_ratio"))


def offline(parameters: dict, waves: dict[int, list[list[int]]], new_tokens: int, stream: bool = False,
            structured_share: float = 0.0) -> dict[int, dict]:
    """The engine alone on the same requests, wave by wave; stream=True: every request streams its outputs
    (detokenized each step by the output thread), as the served path does before Triton's own work."""
    from backend import Engine, EngineConfig, SamplingParams
    from bench.offline import constrain, stream_all

    cfg = EngineConfig.from_dict({k: v for k, v in parameters.items() if k in EngineConfig.__dataclass_fields__})
    engine = Engine(cfg)
    out = {}
    try:
        plain = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        engine.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        for n, prompts in waves.items():
            # the same requests as the served wave: its first share constrained
            params = constrain([plain] * n, structured_share) if structured_share else plain
            start = time.perf_counter()
            outs = stream_all(engine, prompts, params) if stream else engine.generate(prompts, params)
            wall = time.perf_counter() - start
            tokens = sum(len(o.token_ids) for o in outs)
            out[n] = dict(wall_s=round(wall, 3), tok_per_s=round(tokens / wall, 1))
        pauses = {k: v for k, v in engine.stats().items() if k.startswith("gc_")}
        print(f"engine  gc={pauses}", flush=True)
    finally:
        engine.shutdown()
        del engine
        gc.collect()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="random:llama-3-8b")
    ap.add_argument("--concurrency", default="32,64,128")
    ap.add_argument("--prompt-len", default="128,1024")
    ap.add_argument("--new-tokens", type=int, default=512)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--log", default=None, help="tritonserver log file")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="an engine setting for the served model and the engine alone, e.g. gc_freeze=false")
    ap.add_argument("--engine-stream", action="store_true",
                    help="also run the engine alone with streamed, per-step detokenized outputs")
    ap.add_argument("--rates", default=None,
                    help="open-loop Poisson arrivals of a realistic mix at these rates (req/s, or '0.9x' of the "
                         "engine alone's request rate), one after another")
    ap.add_argument("--mix-requests", type=int, default=500, help="--rates: requests sent at each rate")
    ap.add_argument("--decoding", default="sampled", choices=["sampled", "greedy"], help="--rates: the mix's decoding")
    ap.add_argument("--slo-ttft-ms", type=float, default=1000.0, help="--rates: goodput's TTFT limit")
    ap.add_argument("--structured-share", type=float, default=0.0, metavar="S",
                    help="waves: this share of each wave's requests follow a JSON schema (structured outputs); "
                         "their inter-token latency and the others' are reported apart, and the others' also "
                         "against a wave of them alone sent just before")
    ap.add_argument("--slo-tpot-ms", type=float, default=50.0, help="--rates: goodput's TPOT limit")
    args = ap.parse_args(argv)
    if args.rates:
        return open_loop_main(args)
    levels = [int(x) for x in args.concurrency.split(",")]
    lo, hi = (int(x) for x in args.prompt_len.split(","))
    parameters = {"model": args.model, "max_num_seqs": str(max(levels)), "max_model_len": str(args.max_model_len),
                  "max_num_batched_tokens": "8192", "timeline": "true"}
    parameters.update(item.split("=", 1) for item in args.set)
    waves = {n: make_requests(n, (lo, hi), args.new_tokens, seed=n) for n in levels}
    print(f"# serve_bench: model {args.model}, concurrency {levels}, prompt {lo}-{hi}, new tokens {args.new_tokens}",
          flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="serve-bench-"))
    repo = make_model_repository(tmp, parameters)
    http, grpc, metrics = free_ports(3)
    proc = start_server(repo, http, grpc, metrics, log_path=args.log or tmp / "tritonserver.log")
    served = {}
    try:
        wait_until_ready(proc, http, timeout=900, model_name="llm")
        asyncio.run(drive(f"localhost:{grpc}", waves[levels[0]][:4], 8))  # warm-up
        for n in levels:
            constrained = round(n * args.structured_share)
            alone = asyncio.run(drive(f"localhost:{grpc}", waves[n][constrained:], args.new_tokens)) \
                if constrained else None
            before = scrape(metrics)
            served[n] = asyncio.run(drive(f"localhost:{grpc}", waves[n], args.new_tokens, constrained=constrained))
            if alone is not None:
                served[n].update(structured_ratios(served[n], alone))
            time.sleep(0.6)  # why: the sender flushes its latency figures every 0.1 s and the gauges every 0.5 s
            served[n].update(server_side(before, scrape(metrics)))
            print(f"triton  concurrency={n}  " + "  ".join(f"{k}={v}" for k, v in served[n].items()), flush=True)
    finally:
        stop_server(proc)
    engine = offline(parameters, waves, args.new_tokens, structured_share=args.structured_share)
    streamed = offline(parameters, waves, args.new_tokens, stream=True, structured_share=args.structured_share) \
        if args.engine_stream else {}
    for n in levels:
        served[n]["engine_tok_per_s"] = engine[n]["tok_per_s"]
        served[n]["triton_vs_engine"] = round(served[n]["tok_per_s"] / engine[n]["tok_per_s"], 3)
        if n in streamed:
            served[n]["engine_streamed_tok_per_s"] = streamed[n]["tok_per_s"]
        print(f"engine  concurrency={n}  tok_per_s={engine[n]['tok_per_s']}  "
              f"streamed_tok_per_s={streamed.get(n, {}).get('tok_per_s')}  "
              f"triton/engine={served[n]['triton_vs_engine']}", flush=True)
    print(json.dumps({"model": args.model, "new_tokens": args.new_tokens, "levels": served}))
    return 0


def mix_requests(num: int, decoding: str) -> tuple[list[list[int]], list]:
    """The realistic mix's prompts (token ids) and engine sampling params (bench/traffic.py); its ids stay below 250,
    valid in every model here, so the vocabulary passed is that bound."""
    from bench.traffic import TrafficMix

    return TrafficMix(num).build(250, decoding)


def as_client_request(ids: list[int], params):
    """The same request in the vLLM-backend conventions the server takes."""
    from tandem_client import GenerateRequest

    return GenerateRequest(input_ids=ids, max_tokens=params.max_tokens, temperature=params.temperature,
                           top_p=params.top_p if params.top_p < 1 else None, seed=params.seed, ignore_eos=True)


def offline_mix(parameters: dict, prompts: list[list[int]], params: list) -> dict:
    """The engine alone on the whole mix, queued at once: its request rate and output tok/s."""
    from backend import Engine, EngineConfig, SamplingParams

    engine = Engine(EngineConfig.from_dict({k: v for k, v in parameters.items()
                                            if k in EngineConfig.__dataclass_fields__}))
    try:
        engine.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        start = time.perf_counter()
        outs = engine.generate(prompts, params)
        wall = time.perf_counter() - start
    finally:
        engine.shutdown()
        del engine
        gc.collect()
    tokens = sum(len(o.token_ids) for o in outs)
    return dict(wall_s=round(wall, 3), requests_per_s=round(len(prompts) / wall, 3),
                output_tok_per_s=round(tokens / wall, 1))


def open_loop_main(args) -> int:
    prompts, params = mix_requests(args.mix_requests, args.decoding)
    longest = max(len(p) + q.max_tokens for p, q in zip(prompts, params))
    parameters = {"model": args.model, "max_num_seqs": "256", "max_model_len": str(max(args.max_model_len, longest)),
                  "max_num_batched_tokens": "8192", "timeline": "true"}
    parameters.update(item.split("=", 1) for item in args.set)
    slo = Slo(args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3)
    print(f"# serve_bench open loop: model {args.model}, {len(prompts)} requests per rate, {args.decoding}, rates "
          f"{args.rates}, SLO TTFT <= {args.slo_ttft_ms} ms and TPOT <= {args.slo_tpot_ms} ms", flush=True)
    alone = offline_mix(parameters, prompts, params)
    print("engine  " + "  ".join(f"{k}={v}" for k, v in alone.items()), flush=True)
    rates = [float(r[:-1]) * alone["requests_per_s"] if r.endswith("x") else float(r) for r in args.rates.split(",")]
    requests = [as_client_request(ids, p) for ids, p in zip(prompts, params)]
    tmp = Path(tempfile.mkdtemp(prefix="serve-bench-"))
    repo = make_model_repository(tmp, parameters)
    http, grpc, metrics = free_ports(3)
    proc = start_server(repo, http, grpc, metrics, log_path=args.log or tmp / "tritonserver.log")
    levels = []
    try:
        wait_until_ready(proc, http, timeout=900, model_name="llm")
        asyncio.run(drive(f"localhost:{grpc}", [prompts[0][:8]] * 2, 4))  # warm-up
        for i, rate in enumerate(rates):
            result = asyncio.run(_open_loop(f"localhost:{grpc}", requests, poisson_arrivals(len(requests), rate, i),
                                            slo))
            # offered: the output tok/s of these requests arriving at this rate, so 1.0 means the server kept up
            offered = alone["output_tok_per_s"] * rate / alone["requests_per_s"]
            result.update(rate=round(rate, 3), vs_engine_tok_per_s=round(
                result["output_tok_per_s"] / alone["output_tok_per_s"], 3),
                vs_offered_tok_per_s=round(result["output_tok_per_s"] / offered, 3))
            levels.append(result)
            print("triton  " + "  ".join(f"{k}={v}" for k, v in result.items()), flush=True)
    finally:
        stop_server(proc)
    print(json.dumps({"model": args.model, "decoding": args.decoding, "slo_ms": [args.slo_ttft_ms, args.slo_tpot_ms],
                      "engine": alone, "rates": levels}))
    return 0


async def _open_loop(url: str, requests: list, times: list[float], slo: Slo) -> dict:
    from tandem_client import AsyncClient

    client = AsyncClient(url, protocol="grpc")
    try:
        timings, wall = await run_open_loop(lambda req: timed_stream(client.stream(req)), requests, times)
    finally:
        await client.close()
    return summarize(timings, wall, slo)


if __name__ == "__main__":
    raise SystemExit(main())
