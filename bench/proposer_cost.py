"""python -m bench.proposer_cost: the host's cost of the n-gram and suffix proposers, which run on the engine thread
(a drafted step's proposing is time the GPU waits).

Token histories are drawn from a Zipf law over a vocabulary, as text's tokens roughly are (a few tokens very common):
- a proposal per proposer for a request history of --history tokens ending in tokens of several frequencies, with
  the suffix proposer's shared history of recent outputs filled to --shared tokens: µs a proposal;
- the suffix proposer taking --outputs finished outputs of --output-len tokens (Speculator.finished): the mean and
  the worst µs of one, the worst being when its shared history turns over;
- a request's history built from a prompt of --prompt tokens (at a row's first proposal or guess): µs.
Prints a table and one JSON line."""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from backend.speculative.ngram import NgramProposer
from backend.speculative.suffix import SuffixProposer
from backend.speculative.token_history import TokenHistory


def zipf_tokens(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    return (rng.zipf(1.2, size=n) % vocab).tolist()


def per_call_us(fn, repeats: int) -> float:
    """The median of `repeats` timed calls, in µs."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--history", type=int, default=600, help="a request's tokens (prompt and output)")
    ap.add_argument("--shared", type=int, default=1_000_000, help="tokens of recent outputs the suffix proposer holds")
    ap.add_argument("--outputs", type=int, default=2200, help="finished outputs fed to a fresh suffix proposer")
    ap.add_argument("--output-len", type=int, default=500)
    ap.add_argument("--prompt", type=int, default=32000, help="a prompt's tokens, for a history's first build")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=50)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    print(f"# proposer_cost: Zipf(1.2) tokens over {args.vocab:,} ids, request history {args.history}, shared outputs "
          f"{args.shared:,} tokens, k = {args.k}", flush=True)
    suffix, ngram = SuffixProposer(), NgramProposer()
    fill = zipf_tokens(rng, args.shared, args.vocab)
    for start in range(0, len(fill), args.output_len):  # the shared history, as finished outputs
        suffix.finished(TokenHistory(fill[start:start + args.output_len]), 0)
    request = zipf_tokens(rng, args.history - 1, args.vocab)
    common = np.bincount(np.asarray(fill), minlength=args.vocab)
    order = np.argsort(-common, kind="stable")
    rows = []
    for rank in (0, 1, 100, 5000):  # the last token: the most common, the second, ... a rare one
        last = int(order[rank])
        history = TokenHistory(request + [last])
        rows.append(dict(last_token_rank=rank, occurrences=int(common[last]),
                         ngram_us=round(per_call_us(lambda: ngram.propose(history, args.k), args.repeats), 1),
                         suffix_us=round(per_call_us(lambda: suffix.propose(history, args.k), args.repeats), 1)))
    fresh, finished = SuffixProposer(), []
    for _ in range(args.outputs):
        output = TokenHistory(zipf_tokens(rng, args.output_len, args.vocab))
        start = time.perf_counter()
        fresh.finished(output, 0)
        finished.append((time.perf_counter() - start) * 1e6)
    prompt = np.asarray(zipf_tokens(rng, args.prompt, args.vocab), dtype=np.int64)
    build = per_call_us(lambda: TokenHistory(prompt), 5)
    print(f"{'last token':>16}  {'occurrences':>11}  {'ngram µs':>8}  {'suffix µs':>9}")
    for r in rows:
        print(f"{'rank ' + str(r['last_token_rank']):>16}  {r['occurrences']:>11,}  {r['ngram_us']:>8.1f}  "
              f"{r['suffix_us']:>9.1f}")
    result = dict(proposals=rows, finished_mean_us=round(statistics.fmean(finished), 1),
                  finished_worst_us=round(max(finished), 1), history_build_us=round(build, 1),
                  prompt_tokens=args.prompt)
    print(f"suffix finished(): mean {result['finished_mean_us']:,.1f} µs, "
          f"worst {result['finished_worst_us']:,.1f} µs "
          f"({args.outputs} outputs of {args.output_len}); a {args.prompt:,}-token prompt's history: "
          f"{result['history_build_us']:,.1f} µs")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
