"""python -m bench.grammar_stall: does compiling a new grammar stall the engine loop while streams decode?

N streams decode (8B shape by default, greedy, EOS ignored). Once they all decode, a request with a tool schema of
about 2 KB that no request used before arrives and is compiled on the caller's thread (as Triton's execute thread
does); then a second, again new. Before them a request with no schema arrives the same way: what any request's
joining costs the loop (its prefill, the step that is not a replayed graph), for the others to be read against.
The loop's step durations are recorded throughout, and for each arrival the longest step between its arrival and
its first token is set against the median step of the steady decode before it. Prints a table and one JSON
line."""
from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

from backend import Engine, EngineConfig, SamplingParams

# per property: a name, a JSON-schema type and a description, so the schema reads as a real tool's parameters
FIELDS = [("city", {"type": "string"}), ("country_code", {"type": "string", "pattern": "^[A-Z]{2}$"}),
          ("unit", {"type": "string", "enum": ["celsius", "fahrenheit", "kelvin"]}),
          ("days", {"type": "integer", "minimum": 1, "maximum": 14}),
          ("hourly", {"type": "boolean"}), ("include_alerts", {"type": "boolean"}),
          ("latitude", {"type": "number", "minimum": -90, "maximum": 90}),
          ("longitude", {"type": "number", "minimum": -180, "maximum": 180}),
          ("fields", {"type": "array", "items": {"type": "string", "enum": ["temp", "wind", "rain", "uv"]},
                      "maxItems": 4}),
          ("language", {"type": "string", "enum": ["en", "fr", "de", "ja", "es"]})]


def tool_schema(seed: int) -> dict:
    """An OpenAI function's parameters schema of about 2 KB, its property names made unique by seed (no cache hit)."""
    properties = {f"{name}_{seed}": dict(spec, description=f"The {name.replace('_', ' ')} the forecast is for; "
                                                           f"see the documentation of the tool, version {seed}, for what it accepts.")
                  for name, spec in FIELDS}
    properties[f"options_{seed}"] = {"type": "object", "properties": {
        "detail": {"type": "string", "enum": ["brief", "full"]}, "max_words": {"type": "integer", "minimum": 10}},
        "required": ["detail"], "additionalProperties": False}
    names = list(properties)
    return {"type": "object", "properties": properties, "required": names[:4], "additionalProperties": False}


class StepClock:
    """Records the wall-clock span of every step the engine loop takes (wraps the loop's _step)."""

    def __init__(self, loop) -> None:
        self.spans: list[tuple[float, float]] = []
        inner = loop._step

        def timed() -> bool:
            start = time.perf_counter()
            worked = inner()
            if worked:
                self.spans.append((start, time.perf_counter()))
            return worked

        loop._step = timed  # the loop looks _step up on every iteration

    def between(self, start: float, end: float) -> list[float]:
        """Durations (ms) of the steps that ended after start and began before end."""
        return [(e - s) * 1e3 for s, e in list(self.spans) if e > start and s < end]


def arrive(engine: Engine, clock: StepClock, seed: int | None, steady_s: float) -> dict:
    """One request arrives, with a new schema (seed) or none; the time add_request took (its compile), its
    first-token wait and the loop's steps around it."""
    before = time.perf_counter()
    time.sleep(steady_s)
    arrival = time.perf_counter()
    schema = tool_schema(seed) if seed is not None else None
    params = SamplingParams(max_tokens=16, temperature=0.0,
                            structured_outputs={"json": schema} if schema is not None else None)
    stream = engine.add_request([11, 12, 13, 14], params)
    compiled = time.perf_counter()
    first = None
    for out in stream:
        if first is None and out.token_ids:
            first = time.perf_counter()
    steady = clock.between(before, arrival)
    during = clock.between(arrival, first or time.perf_counter())
    median = statistics.median(steady) if steady else float("nan")
    return {"schema_bytes": len(json.dumps(schema)) if schema is not None else 0, "compile_ms": round((compiled - arrival) * 1e3, 1),
            "first_token_ms": round(((first or compiled) - arrival) * 1e3, 1), "steady_steps": len(steady),
            "median_step_ms": round(median, 2), "steps_during": len(during),
            "max_step_during_ms": round(max(during), 2) if during else None,
            "max_over_median": round(max(during) / median, 2) if during else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="random:llama-3-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--streams", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=1024)
    ap.add_argument("--steady-s", type=float, default=2.0, help="steady decode recorded before each arrival")
    ap.add_argument("--async-pipeline", default="true", choices=["true", "false"])
    args = ap.parse_args()
    print(f"# grammar_stall: model {args.model}, {args.streams} streams x {args.new_tokens} new tokens, "
          f"async {args.async_pipeline}", flush=True)
    engine = Engine(EngineConfig(model=args.model, device=args.device, max_num_seqs=max(args.streams + 1, 8),
                                 async_pipeline=args.async_pipeline == "true"))
    try:
        clock = StepClock(engine.loop)
        free = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
        streams = [engine.add_request([3 + i % 200] * 64, free, stream=False) for i in range(args.streams)]
        drained = threading.Thread(target=lambda: [list(s) for s in streams], daemon=True)
        drained.start()
        while len(clock.spans) < 20:  # the prompts' prefill is behind us: every row decodes
            time.sleep(0.05)
        rows = {"plain": arrive(engine, clock, None, args.steady_s), "first": arrive(engine, clock, 1, args.steady_s),
                "second": arrive(engine, clock, 2, args.steady_s)}
        for name, row in rows.items():
            print(f"{name:7s} " + "  ".join(f"{k}={v}" for k, v in row.items()), flush=True)
        for stream in streams:
            engine.abort(stream.request_id)
        drained.join(timeout=60)
    finally:
        engine.shutdown()
    print(json.dumps({"model": args.model, "streams": args.streams, "async": args.async_pipeline == "true", **rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
