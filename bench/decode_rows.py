"""CPU microbenchmark of the decode rows' host work a step: one row leaving, one joining, the advance, the accept
and the pack of N decode rows of the running batch (no model, no device).

`python -m bench.decode_rows [--rows 256] [--steps 2000]` prints the median µs of each, then one JSON line.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import numpy as np
import torch

from backend.core.scheduler import ScheduledBatch
from backend.core.running_batch import RunningBatch
from backend.executor.packer import SlotPacker
from backend.executor.pipeline import Pipeline, SlotLayout
from backend.request import Request, SamplingParams
from backend.runtime.timeline import Timeline

BLOCK_SIZE, MAX_BLOCKS = 16, 2048  # the block-table width of a 32K max_model_len, the engine's default cap


class _Blocks:
    """Block ids handed out in order, as a KV cache with room for every row would."""

    def __init__(self) -> None:
        self.next = 1

    def take(self, n: int) -> list[int]:
        self.next += n
        return list(range(self.next - n, self.next))


def _request(i: int, rng: random.Random, blocks: _Blocks) -> Request:
    """A decoding request with a prompt of 20-2,000 tokens, computed and holding exactly the blocks it covers."""
    p = rng.randint(20, 2000)
    req = Request(f"r{i}", [3] * p, SamplingParams(max_tokens=100_000, temperature=0.0), seed=i,
                  eos_token_ids=frozenset({2}))
    req.final_only = True
    req.num_computed_tokens = p
    req.num_tokens = p + 1
    req.block_ids = blocks.take(-(-p // BLOCK_SIZE))
    return req


def run(rows: int = 256, steps: int = 2000, seed: int = 3) -> dict[str, float]:
    """Median µs of each part over `steps` steps (the first tenth left out as warm-up)."""
    rng, blocks = random.Random(seed), _Blocks()
    layout = SlotLayout(max_tokens=8192, max_seqs=2 * rows, max_blocks=MAX_BLOCKS, max_logprobs=0)
    pipeline = Pipeline(layout, torch.device("cpu"), Timeline())
    packer = SlotPacker(pipeline, layout, BLOCK_SIZE, torch.device("cpu"))
    sb = RunningBatch(BLOCK_SIZE, 10**6, MAX_BLOCKS)
    sb._append([_request(i, rng, blocks) for i in range(rows)], np.zeros(rows, dtype=np.int64))
    times: dict[str, list[float]] = {"delete": [], "append": [], "advance": [], "accept": [], "pack": []}
    tokens, prev = list(range(rows)), None
    clock = time.perf_counter
    for step in range(steps):
        gone, newcomer = np.array([rng.randrange(len(sb))]), _request(rows + step, rng, blocks)
        t0 = clock()
        sb._delete(gone)
        t1 = clock()
        sb._append([newcomer], np.array([0]))
        t2 = clock()
        need = sb.rows_needing_block()
        if need.size:
            new = blocks.take(need.size)
            for row, block in zip(need.tolist(), new):
                sb.requests[row].block_ids.append(block)
            sb.add_blocks(need, new)
        t3 = clock()
        sb.advance(step)
        t4 = clock()
        batch = ScheduledBatch(step, sb, num_rows=rows, requests=list(sb.requests), num_new_tokens=[1] * rows,
                               samples=[True] * rows, num_tokens=rows, is_decode_only=True)
        t5 = clock()
        prev = packer.pack(batch, prev)
        t6 = clock()
        sb.packed_rows[prev.rows_version].accept(tokens)
        t7 = clock()
        for name, span in (("delete", t1 - t0), ("append", t2 - t1), ("advance", t4 - t3), ("pack", t6 - t5),
                           ("accept", t7 - t6)):
            times[name].append(span)
        pipeline.slots[prev.slot.index].in_use = False  # no device: the step's results are "read" at once
    skip = steps // 10
    return {name: round(statistics.median(v[skip:]) * 1e6, 1) for name, v in times.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=256, help="decode rows")
    ap.add_argument("--steps", type=int, default=2000, help="steps timed")
    args = ap.parse_args(argv)
    result = run(args.rows, args.steps)
    for name, us in result.items():
        print(f"{name:8s} {us:8.1f} µs")
    print(json.dumps({"rows": args.rows, "steps": args.steps, "median_us": result}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
