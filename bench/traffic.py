"""A realistic traffic mix for the offline benchmark: prompt and output lengths drawn from log-normal
distributions (the shape of real conversation logs: most requests short, a long tail), greedy or sampled decoding,
and a chat variant whose requests share one system prompt (prefix-cache hits).

Parameters (the issue's "1B / 8B mix"): prompt lengths log-normal with median 220 tokens and sigma 0.8, cut to
[4, 2,048]; output lengths log-normal with median 160 and sigma 0.8, cut to [1, 1,024]; sampled decoding draws each
request's temperature uniformly in [0.7, 0.8] with top-p 0.95 and a seed of its own. Everything is drawn from one
seeded generator, so a workload is the same requests on every machine.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

from backend import SamplingParams

SYSTEM_PROMPT_TOKENS = 500  # the chat variant's shared prefix


@dataclass(frozen=True)
class TrafficMix:
    """How many requests, and the distributions their lengths are drawn from."""

    num_requests: int
    prompt_median: int = 220
    output_median: int = 160
    sigma: float = 0.8
    max_prompt: int = 2048
    max_output: int = 1024
    chat: bool = False  # every prompt starts with the same SYSTEM_PROMPT_TOKENS-token system prompt

    @property
    def max_model_len(self) -> int:
        return self.max_prompt + self.max_output + (SYSTEM_PROMPT_TOKENS if self.chat else 0)

    def build(self, vocab: int, decoding: str, seed: int = 0) -> tuple[list[list[int]], list[SamplingParams]]:
        """(prompts as token ids, their sampling params); decoding is "greedy" or "sampled". EOS is ignored, so
        each request generates exactly its drawn output length."""
        if decoding not in ("greedy", "sampled"):
            raise ValueError(f"decoding must be 'greedy' or 'sampled', got {decoding!r}")
        rng = random.Random(seed)  # lengths and tokens: the same requests whatever the decoding
        knobs = random.Random(seed + 1)  # the sampled variant's temperatures
        top = min(vocab, 250)
        system = [rng.randrange(3, top) for _ in range(SYSTEM_PROMPT_TOKENS)] if self.chat else []
        prompts, params = [], []
        for i in range(self.num_requests):
            prompt_len = _lognormal(rng, self.prompt_median, self.sigma, 4, self.max_prompt)
            output_len = _lognormal(rng, self.output_median, self.sigma, 1, self.max_output)
            prompts.append(system + [rng.randrange(3, top) for _ in range(prompt_len)])
            if decoding == "greedy":
                params.append(SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True))
            else:
                params.append(SamplingParams(max_tokens=output_len, temperature=round(knobs.uniform(0.7, 0.8), 3),
                                             top_p=0.95, seed=seed * 1_000_003 + i, ignore_eos=True))
        return prompts, params


def _lognormal(rng: random.Random, median: float, sigma: float, low: int, high: int) -> int:
    return max(low, min(high, int(round(math.exp(rng.gauss(math.log(median), sigma))))))
