"""python -m bench.spec_acceptance: how many draft tokens each speculative proposer gets accepted, on the real default
model (SmolLM2-135M-Instruct) and two workloads shipped as data.

- copy: requests whose answers repeat their prompts (edit this code and return it, number or sort this list, repeat
  or lightly change a paragraph): bench/data/spec_copy_tasks.jsonl, and passages of bench/data/quality_text.txt;
- chat: the first prompts of bench/data/quality_prompts.txt (questions, instructions, story continuations).

The model's own greedy outputs are generated once (the engine, EOS ends them). Greedy speculation keeps exactly those
tokens, so each proposer is replayed over them: at every step it proposes k tokens from the prompt and the output so
far, the longest prefix equal to the model's next tokens is accepted, and the model's next token after them comes
free. Requests are replayed in order, so the suffix proposer learns from the outputs before. Reported per workload,
proposer and k: tokens per verify step (accepted + 1; batch-1 speed-up if a verify step cost one decode step),
accepted per step, and the share of proposed tokens accepted. Prints a table and one JSON line.

With --speed (a GPU run), also the copy workload's speed at batch 1: its requests one at a time through the engine
without speculation and with each proposer (k = --speed-k, the draft policy on), output tokens a second over the
wall time, and whether each run's outputs equal the run's without speculation."""
from __future__ import annotations

import argparse
import json
import os
import time

from backend import Engine, EngineConfig, SamplingParams
from backend.speculative.proposer import make_proposer
from backend.speculative.token_history import TokenHistory

PROPOSERS = ("ngram", "suffix")  # the proposers without a model (a draft model needs a smaller one of this tokenizer)
DATA = os.path.join(os.path.dirname(__file__), "data")
PASSAGE_TASKS = ["Repeat this paragraph word for word:", "Copy this paragraph, writing every number as digits:",
                 "Rewrite this paragraph with modern spelling, changing nothing else:",
                 "Return this paragraph with each sentence on its own line:"]


def copy_prompts(passages: int) -> list[str]:
    """The code and list tasks, then passage tasks over the text's paragraphs of 300 to 900 characters."""
    with open(os.path.join(DATA, "spec_copy_tasks.jsonl")) as f:
        prompts = [json.loads(line)["user"] for line in f if line.strip()]
    with open(os.path.join(DATA, "quality_text.txt")) as f:
        paragraphs = [p.strip() for p in f.read().split("\n\n") if 300 <= len(p.strip()) <= 900]
    for i, paragraph in enumerate(paragraphs[:passages]):
        prompts.append(f"{PASSAGE_TASKS[i % len(PASSAGE_TASKS)]}\n\n{paragraph}")
    return prompts


def chat_prompts(count: int) -> list[str]:
    with open(os.path.join(DATA, "quality_prompts.txt")) as f:
        return [line.strip() for line in f if line.strip()][:count]


def greedy_outputs(engine: Engine, prompts: list[str], max_tokens: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, greedy output ids) per prompt, each prompt a user message in the model's chat template."""
    tok = engine.tokenizer
    ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
           for p in prompts]
    ids = [list(x["input_ids"]) if hasattr(x, "keys") else list(x) for x in ids]  # a BatchEncoding in transformers 5
    outs = engine.generate(ids, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    return [(p, list(o.token_ids)) for p, o in zip(ids, outs)]


def replay(method: str, k: int, requests: list[tuple[list[int], list[int]]]) -> dict:
    """Greedy speculation with this proposer over the model's own outputs, request after request."""
    proposer = make_proposer(method)
    steps = accepted = proposed = tokens = 0
    for prompt, output in requests:
        history = TokenHistory(prompt)
        done = 0
        while done < len(output):
            draft = proposer.propose(history, k)
            match = 0
            while match < len(draft) and done + match < len(output) and draft[match] == output[done + match]:
                match += 1
            emitted = output[done:done + match + 1]  # the accepted drafts and the model's own next token
            history.extend(emitted)
            done += len(emitted)
            steps += 1
            accepted += match
            proposed += len(draft)
        proposer.finished(history, len(prompt))
        tokens += len(output)
    return {"method": method, "k": k, "requests": len(requests), "tokens": tokens, "steps": steps,
            "tokens_per_step": round(tokens / steps, 3) if steps else None,
            "accepted_per_step": round(accepted / steps, 3) if steps else None,
            "acceptance": round(accepted / proposed, 3) if proposed else None}


def batch1_speed(device: str, requests: list[tuple[list[int], list[int]]], warm_up: list[int], max_tokens: int,
                 k: int) -> list[dict]:
    """The requests' prompts one at a time (max_num_seqs 1) without speculation, then with each proposer."""
    prompts = [p for p, _ in requests]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    rows, want = [], None
    for method in ("", *PROPOSERS):
        engine = Engine(EngineConfig(device=device, max_num_seqs=1, max_model_len=2048, speculative_method=method,
                                     num_speculative_tokens=k))
        try:
            engine.generate([warm_up], params)  # a prompt outside the workload: the suffix tree learns nothing of it
            began = time.perf_counter()
            outs = [list(o.token_ids) for o in engine.generate(prompts, params)]
            wall = time.perf_counter() - began
            counts = engine.speculator.counts() if engine.speculator is not None else {}
        finally:
            engine.shutdown()
        want = outs if want is None else want
        tokens = sum(len(o) for o in outs)
        steps = counts.get("spec_drafts", 0)
        rows.append({"method": method or "none", "k": k if method else 0, "tokens": tokens, "wall_s": round(wall, 3),
                     "tok_per_s": round(tokens / wall, 1), "same_outputs": outs == want,
                     "drafted_steps": counts.get("spec_steps", 0),
                     "tokens_per_draft": round(1 + counts["spec_accepted_tokens"] / steps, 3) if steps else None})
    base = rows[0]["tok_per_s"]
    for row in rows:
        row["speedup"] = round(row["tok_per_s"] / base, 3)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--chat", type=int, default=40, help="chat prompts (the first of quality_prompts.txt)")
    ap.add_argument("--passages", type=int, default=8, help="passage tasks added to the copy workload")
    ap.add_argument("--ks", default="2,4,8")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--speed", action="store_true", help="also the copy workload's batch-1 speed per proposer")
    ap.add_argument("--speed-k", type=int, default=4)
    args = ap.parse_args()
    ks = [int(k) for k in args.ks.split(",")]
    engine = Engine(EngineConfig(device=args.device, max_num_seqs=64, max_model_len=2048))
    try:
        workloads = {"copy": greedy_outputs(engine, copy_prompts(args.passages), args.max_tokens),
                     "chat": greedy_outputs(engine, chat_prompts(args.chat), args.max_tokens)}
    finally:
        engine.shutdown()
    print(f"# spec_acceptance: SmolLM2-135M-Instruct greedy, max {args.max_tokens} new tokens, "
          f"{len(workloads['copy'])} copy and {len(workloads['chat'])} chat requests, device {args.device}")
    print(f"{'workload':9s} {'method':7s} {'k':>2s} {'tokens/step':>11s} {'accepted/step':>13s} {'acceptance':>10s}")
    rows = []
    for name, requests in workloads.items():
        for method in PROPOSERS:
            for k in ks:
                row = {"workload": name, **replay(method, k, requests)}
                rows.append(row)
                print(f"{name:9s} {method:7s} {k:2d} {row['tokens_per_step']:>11} {row['accepted_per_step']:>13} "
                      f"{row['acceptance']:>10}")
    speed = []
    if args.speed:
        speed = batch1_speed(args.device, workloads["copy"], workloads["chat"][0][0], args.max_tokens, args.speed_k)
        print(f"# copy workload at batch 1, device {args.device}")
        print(f"{'method':7s} {'k':>2s} {'tok/s':>8s} {'speed-up':>8s} {'drafted steps':>13s} {'tokens/draft':>12s} same")
        for row in speed:
            print(f"{row['method']:7s} {row['k']:2d} {row['tok_per_s']:8.1f} {row['speedup']:8.3f} "
                  f"{row['drafted_steps']:13d} {str(row['tokens_per_draft']):>12s} {row['same_outputs']}")
    print(json.dumps({"model": "smollm2-135m-instruct", "max_tokens": args.max_tokens, "rows": rows,
                      "batch1_speed": speed}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
