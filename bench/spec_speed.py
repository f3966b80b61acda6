"""python -m bench.spec_speed: what speculative decoding's verify steps cost and give against how often drafts are
right, on a random-weight model shape (default the Llama-3-8B shape) where real proposers' acceptance means nothing.

The drafts come from an oracle proposer, a benchmark device never offered to users: a run without speculation first
records each request's greedy continuation; then, at every step, the oracle proposes the next k tokens of that
continuation, each replaced by another token with probability 1 - alpha (so at alpha = 1 every draft is the model's
own next token, at alpha = 0 none is). Greedy verification keeps the leading drafts equal to the model's tokens. With
random weights' near-uniform logits, a verify step's other shapes round differently and part from the recording, so
by default the weights are made peaked first (make_peaked: same cost, a next token no rounding changes); the
measured acceptance and the share of outputs equal to the recording are printed beside the alpha asked for.

For each batch size, in one process with one copy of the weights: the default engine (asynchronous pipeline, no
speculation), the speculating engine with every request opting out, the speculating engine at each alpha with the
draft policy (a fresh one per run) and, to show what verifying costs, with every row drafting k at every step; with
--draft-model, a draft model's engine too, doing all its drafting work but handing out the oracle's drafts (its cost
at a chosen acceptance). Prints a table and one JSON line; tok/s counts output tokens over the wall time,
"proposed" and "accepted" the run's drafted tokens and those of them kept (raw counts), "kept" the share of drafted
tokens accepted, "tokens/draft" the mean acceptance length (tokens a drafting row emits in a verify step: its
accepted drafts and the model's own token after them), "host µs/step" the median CPU time of
a step outside its wait (the engine timeline's spans) with two of its phases: pack (a drafted step's proposing and
block taking included) and update (its settling and accepting). A drafted step runs on the synchronous pipeline, so
its host time is time the GPU waits. `--model stand-in --device cpu --dtype float32 --no-peaked` measures that host
work alone, anywhere (the stand-in answers at once; without CUDA a step's device work runs inside its launch)."""
from __future__ import annotations

import argparse
import json
import random
import time

import numpy as np

from backend import Engine, EngineConfig, SamplingParams
from backend.speculative.draft_policy import DraftPolicy
from backend.speculative.proposer import Proposer
from backend.speculative.token_history import TokenHistory


HOST_PHASES = ("pack", "update")  # a drafted step's proposing is in its pack; its settling and accepting in update


class OracleProposer(Proposer):
    """Benchmark only: proposes a recorded continuation's next tokens, each corrupted with probability 1 - alpha."""

    name = "oracle"

    def __init__(self, recorded: dict[tuple, list[int]], prompt_len: int, alpha: float, vocab: int,
                 seed: int = 0) -> None:
        self.recorded = recorded  # prompt (as a tuple) -> its greedy continuation
        self.prompt_len = prompt_len
        self.alpha = alpha
        self.vocab = vocab
        self.rng = random.Random(seed)

    def propose(self, history: TokenHistory, k: int) -> list[int]:
        tokens = history.tokens
        continuation = self.recorded.get(tuple(tokens[:self.prompt_len].tolist()))
        if continuation is None:
            return []
        at = len(tokens) - self.prompt_len
        drafts = continuation[at:at + k]
        return [t if self.rng.random() < self.alpha else (t + 1 + self.rng.randrange(self.vocab - 1)) % self.vocab
                for t in drafts]


class OracleDraftProposer(Proposer):
    """Benchmark only: a draft model's proposer that does all its work (its forwards, its cache, at every step) but
    hands out the oracle's drafts, so the speed of draft-model speculation shows at a chosen acceptance."""

    name = "oracle-draft"
    drafts_together = True

    def __init__(self, draft: Proposer, oracle: OracleProposer) -> None:
        self.draft, self.oracle = draft, oracle

    def prepare(self, histories, ks) -> None:
        self.draft.prepare(histories, ks)

    def propose(self, history: TokenHistory, k: int) -> list[int]:
        return self.oracle.propose(history, k) if self.draft.propose(history, k) else []

    def finished(self, history: TokenHistory, prompt_length: int) -> None:
        self.draft.finished(history, prompt_length)

    def forget_all(self) -> None:
        self.draft.forget_all()


def timed_generate(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> tuple[list, float, dict]:
    """(outputs, wall seconds, the host's time a step: the median µs per step and per phase, from the timeline)."""
    engine.set_timeline(True)
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    seconds = time.perf_counter() - start
    engine.set_timeline(False)
    time.sleep(0.05)  # the loop applies the switch at its next step
    summary = engine.timeline.summary()
    phases = summary.get("cpu_us_by_phase", {})
    host = dict(cpu_us_per_step=round(summary["cpu_us_per_step"], 1),
                **{f"cpu_us_{phase}": phases.get(phase, 0.0) for phase in HOST_PHASES})
    return outs, seconds, host


def make_peaked(model) -> None:
    """Benchmark only: each layer's output projections zero and the LM head a copy of the embeddings (in place, so
    captured graphs keep their addresses). The residual stream is then the last token's embedding, whose logit beats
    every other by a wide margin: the next token is the last one again, and no rounding of any path (graph or eager,
    one token or several a row) can change it, so a recorded continuation is what every step computes. Random
    weights' near-uniform logits would otherwise let the verify step's other shapes flip the argmax and part from the
    recording. The forward's cost does not depend on the weights' values."""
    for layer in model.layers:
        layer.o_weight.data.zero_()
        layer.down_weight.data.zero_()
    if model.lm_head is not model.embed_tokens:
        model.lm_head.data.copy_(model.embed_tokens.data)


def run_batch(plain: Engine, spec: Engine, batch: int, args, vocab: int, drafting: Engine | None) -> list[dict]:
    rng = random.Random(batch)
    prompts = [[rng.randrange(3, min(vocab, 30000)) for _ in range(args.prompt_len)] for _ in range(batch)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    plain.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))  # warm: one-off set-up
    outs, seconds, host = timed_generate(plain, prompts, params)
    recorded = {tuple(p): list(o.token_ids) for p, o in zip(prompts, outs)}
    warm = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    for engine in (spec, *([drafting] if drafting else [])):  # warm: drafted steps of this size compile their kernels
        engine.speculator.policy = None
        oracle = OracleProposer(recorded, args.prompt_len, 1.0, vocab)
        engine.speculator.proposer = oracle if engine is spec else OracleDraftProposer(args.draft_proposer, oracle)
        engine.generate(prompts, warm)
    tokens = batch * args.max_tokens
    rows = [dict(batch=batch, mode="async, no speculation", alpha=None, tok_per_s=tokens / seconds, **host)]
    opt_out = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True, speculate=False)
    _, seconds, host = timed_generate(spec, prompts, opt_out)
    rows.append(dict(batch=batch, mode="speculating, opted out", alpha=None, tok_per_s=tokens / seconds, **host))
    runs = [(alpha, True, spec) for alpha in args.alphas] + [(alpha, False, spec) for alpha in args.every_step_alphas]
    runs += [(alpha, True, drafting) for alpha in (args.draft_alphas if drafting else [])]
    for alpha, adaptive, engine in runs:
        engine.speculator.policy = DraftPolicy(args.k) if adaptive else None  # a fresh policy: nothing learnt
        oracle = OracleProposer(recorded, args.prompt_len, alpha, vocab, seed=batch)
        engine.speculator.proposer = oracle if engine is spec else OracleDraftProposer(args.draft_proposer, oracle)
        before = engine.speculator.counts()
        got, seconds, host = timed_generate(engine, prompts, params)
        after = engine.speculator.counts()
        proposed, accepted, steps, spans = (after[key] - before[key] for key in
                                            ("spec_proposed_tokens", "spec_accepted_tokens", "spec_steps",
                                             "spec_drafts"))
        same = np.mean([g.token_ids == recorded[tuple(p)] for g, p in zip(got, prompts)])
        mode = ("oracle" if engine is spec else "draft model + oracle") + f" k={args.k}, "
        mode += "policy" if adaptive else "every step"
        rows.append(dict(batch=batch, mode=mode, alpha=alpha, tok_per_s=tokens / seconds,
                         proposed_tokens=proposed, accepted_tokens=accepted,
                         accepted_share=accepted / proposed if proposed else 0.0,
                         mean_acceptance_length=1 + accepted / spans if spans else 1.0, drafted_steps=steps,
                         outputs_as_recorded=float(same), **host))
    base = rows[0]["tok_per_s"]
    for r in rows:
        r["vs_async"] = r["tok_per_s"] / base
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="random:llama-3-8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batches", default="1,8,32,128")
    parser.add_argument("--alphas", default="0,0.5,0.8,1.0", help="with the draft policy")
    parser.add_argument("--every-step-alphas", default="0,1.0",
                        help="with every row drafting k at every step (the policy off); empty for none")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--draft-model", default="",
                        help="a draft model (e.g. random:llama-3.2-1b): runs at --draft-alphas with its forwards done "
                             "but the oracle's drafts handed out, so its cost shows at a chosen acceptance")
    parser.add_argument("--draft-alphas", default="0.8")
    parser.add_argument("--peaked", action=argparse.BooleanOptionalAction, default=True,
                        help="make the model's next token its last one by a wide margin (make_peaked), so every path "
                             "computes the recorded continuation")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=256)
    args = parser.parse_args(argv)
    args.alphas = [float(a) for a in args.alphas.split(",") if a]
    args.every_step_alphas = [float(a) for a in args.every_step_alphas.split(",") if a]
    args.draft_alphas = [float(a) for a in args.draft_alphas.split(",") if a]
    batches = [int(b) for b in args.batches.split(",")]
    blocks = -(-max(batches) * (args.prompt_len + args.max_tokens + args.k + 1) // 16) + max(batches) + 8
    common = dict(model=args.model, device=args.device, dtype=args.dtype, max_num_seqs=max(batches),
                  max_model_len=args.prompt_len + args.max_tokens + args.k + 8, num_kv_blocks=blocks)
    plain = Engine(EngineConfig(**common))
    spec = Engine(EngineConfig(**common, speculative_method="ngram",
                               num_speculative_tokens=args.k), model=plain.parts.model, tokenizer=plain.tokenizer)
    drafting = None
    if args.draft_model:
        drafting = Engine(EngineConfig(**common, speculative_method="draft", speculative_draft_model=args.draft_model,
                                       num_speculative_tokens=args.k), model=plain.parts.model,
                          tokenizer=plain.tokenizer)
        args.draft_proposer = drafting.speculator.proposer
    if args.peaked:
        make_peaked(plain.parts.model)
    vocab = plain.spec.vocab_size
    rows = []
    try:
        for batch in batches:
            rows += run_batch(plain, spec, batch, args, vocab, drafting)
    finally:
        if drafting is not None:
            drafting.shutdown()
        spec.shutdown()
        plain.shutdown()
    print(f"{'batch':>5}  {'mode':<38} {'alpha':>5}  {'tok/s':>9}  {'÷ async':>7}  {'proposed':>8}  {'accepted':>8}  "
          f"{'kept':>5}  {'tokens/draft':>12}  {'as recorded':>11}  {'host µs/step (pack, update)':>27}")
    for r in rows:
        alpha = "" if r["alpha"] is None else f"{r['alpha']:.2f}"
        extra = (f"{r['proposed_tokens']:>8}  {r['accepted_tokens']:>8}  {r['accepted_share']:>5.2f}  "
                 f"{r['mean_acceptance_length']:>12.2f}  {r['outputs_as_recorded']:>11.2f}"
                 if r["alpha"] is not None else " " * 52)
        host = f"{r['cpu_us_per_step']:.0f} ({r['cpu_us_pack']:.0f}, {r['cpu_us_update']:.0f})"
        print(f"{r['batch']:>5}  {r['mode']:<38} {alpha:>5}  {r['tok_per_s']:>9.1f}  {r['vs_async']:>7.3f}  {extra}  "
              f"{host:>27}")
    print(json.dumps({"model": args.model, "draft_model": args.draft_model, "k": args.k, "prompt_len": args.prompt_len,
                      "max_tokens": args.max_tokens, "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
