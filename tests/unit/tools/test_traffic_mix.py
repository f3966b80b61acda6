"""The benchmark's realistic traffic mix: the documented length distributions, the same requests for greedy and
sampled decoding, a shared system prompt in the chat variant, and an offline run that reports its figures."""
from __future__ import annotations

import json
import statistics

from bench import offline
from bench.traffic import SYSTEM_PROMPT_TOKENS, TrafficMix


def test_lengths_follow_the_documented_distributions():
    prompts, params = TrafficMix(4000).build(vocab=512, decoding="greedy")
    prompt_lens = [len(p) for p in prompts]
    output_lens = [p.max_tokens for p in params]
    assert 200 <= statistics.median(prompt_lens) <= 240 and 145 <= statistics.median(output_lens) <= 175
    assert min(prompt_lens) >= 4 and max(prompt_lens) == 2048  # the long tail reaches the cut
    assert min(output_lens) >= 1 and max(output_lens) == 1024
    assert all(p.temperature == 0.0 and p.ignore_eos for p in params)


def test_sampled_variant_has_the_same_requests_and_its_own_settings():
    mix = TrafficMix(300)
    greedy_prompts, greedy = mix.build(vocab=512, decoding="greedy")
    prompts, sampled = mix.build(vocab=512, decoding="sampled")
    assert prompts == greedy_prompts and [p.max_tokens for p in sampled] == [p.max_tokens for p in greedy]
    assert all(0.7 <= p.temperature <= 0.8 and p.top_p == 0.95 for p in sampled)
    assert len({p.seed for p in sampled}) == 300


def test_chat_variant_shares_one_system_prompt():
    prompts, _ = TrafficMix(50, chat=True).build(vocab=512, decoding="greedy")
    system = prompts[0][:SYSTEM_PROMPT_TOKENS]
    assert all(p[:SYSTEM_PROMPT_TOKENS] == system and len(p) > SYSTEM_PROMPT_TOKENS for p in prompts)


def test_offline_mix_run_reports_rates_and_prefix_hits(capsys):
    assert offline.main(["--workload", "cpu-mix", "--requests", "48", "--modes", "async"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    runs = {r["decoding"]: r for r in result["runs"]}
    assert set(runs) == {"greedy", "sampled"}
    assert runs["greedy"]["output_tokens"] == runs["sampled"]["output_tokens"]  # EOS ignored: the drawn lengths
    for r in runs.values():
        assert r["requests"] == 48 and r["requests_per_s"] > 0 and r["total_tok_per_s"] > r["tok_per_s"]
        assert r["prefix_hit_rate"] > 0.3  # the shared system prompt is found in the cache


def test_synthetic_workload_runs_sampled_when_asked(capsys):
    """--decoding on a synthetic workload: greedy by default; sampled runs seeded T 0.8 / top-p 0.95 / top-k 50
    requests of the same lengths (the stand-in's exact-token check is greedy's alone)."""
    argv = ["--workload", "cpu-overhead", "--requests", "8", "--new-tokens", "16", "--modes", "async"]
    assert offline.main(argv) == 0
    greedy = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["runs"]
    assert [r.get("decoding") for r in greedy] == [None] and greedy[0]["all_tokens_exact"] is True
    assert offline.main(argv + ["--decoding", "greedy,sampled"]) == 0
    runs = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["runs"]
    assert [r.get("decoding") for r in runs] == [None, "sampled"]
    assert runs[0]["output_tokens"] == runs[1]["output_tokens"] == 8 * 16
    assert "all_tokens_exact" not in runs[1]
    params = offline.synthetic_params(16, "sampled", seed=3)
    assert (params.temperature, params.top_p, params.top_k, params.seed) == (0.8, 0.95, 50, 3)
