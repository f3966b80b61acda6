"""python -m bench.launch_cost: CPU microseconds of each call a decode step's launch makes (GPU machine).

Builds an engine for a workload's model, then times, with the GPU kept busy so nothing waits: a captured decode
graph's replay at each bucket, entering a stream context, recording and waiting on events, a small pinned
host-to-device copy, and the timeline's GPU span markers. Prints one JSON line.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from backend import Engine, EngineConfig


def per_call_us(fn, n: int = 200) -> float:
    samples = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return round(statistics.median(samples) * 1e6, 2)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="random:llama-3.2-1b")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    args = ap.parse_args(argv)
    engine = Engine(EngineConfig(model=args.model, device="cuda", max_num_seqs=args.max_num_seqs,
                                 max_model_len=2048, timeline=True))
    try:
        runner = engine.runner
        pipe, graphs = runner.pipeline, runner.graphs
        slot = pipe.slots[0]
        s = pipe.compute_stream
        out = {"torch": torch.__version__, "cuda": torch.version.cuda, "buckets": {}}
        with torch.cuda.stream(s):
            for bucket in [b for b in (1, 8, 32, 64, 128, 256) if b in graphs.buckets]:
                g = graphs.graphs[(slot.index, bucket)]
                g.replay()  # warm
                torch.cuda.synchronize()
                out["buckets"][bucket] = per_call_us(g.replay, 50)  # 50 queued replays: the queue never fills
                torch.cuda.synchronize()
        ev = torch.cuda.Event()
        timing = torch.cuda.Event(enable_timing=True)
        host = torch.zeros(4096, dtype=torch.int32, pin_memory=True)
        dev = torch.zeros(4096, dtype=torch.int32, device="cuda")
        tl = engine.timeline

        def span():
            tl.gpu_begin("x", s)
            tl.gpu_end("x", s)

        def stream_ctx():
            with torch.cuda.stream(s):
                pass

        out.update(
            stream_context=per_call_us(stream_ctx),
            event_record=per_call_us(lambda: ev.record(s)),
            timing_event_record=per_call_us(lambda: timing.record(s)),
            stream_wait_event=per_call_us(lambda: s.wait_event(ev)),
            h2d_copy_16kb=per_call_us(lambda: dev.copy_(host, non_blocking=True)),
            slice_copy_16kb=per_call_us(lambda: dev[:4000].copy_(host[:4000], non_blocking=True)),
            timeline_span=per_call_us(span),
            tensor_slice=per_call_us(lambda: dev[:100]),
        )
        torch.cuda.synchronize()
        tl.resolve()
        print(json.dumps(out))
    finally:
        engine.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
