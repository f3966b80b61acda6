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
accepted per step, and the share of proposed tokens accepted. Prints a table and one JSON line."""
from __future__ import annotations

import argparse
import json
import os

from backend import Engine, EngineConfig, SamplingParams
from backend.speculative.proposer import METHODS, make_proposer
from backend.speculative.token_history import TokenHistory

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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--chat", type=int, default=40, help="chat prompts (the first of quality_prompts.txt)")
    ap.add_argument("--passages", type=int, default=8, help="passage tasks added to the copy workload")
    ap.add_argument("--ks", default="2,4,8")
    ap.add_argument("--device", default="cpu")
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
        for method in METHODS:
            for k in ks:
                row = {"workload": name, **replay(method, k, requests)}
                rows.append(row)
                print(f"{name:9s} {method:7s} {k:2d} {row['tokens_per_step']:>11} {row['accepted_per_step']:>13} "
                      f"{row['acceptance']:>10}")
    print(json.dumps({"model": "smollm2-135m-instruct", "max_tokens": args.max_tokens, "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
