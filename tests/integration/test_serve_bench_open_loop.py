"""`python -m bench.serve_bench --rates`: open-loop Poisson arrivals of the realistic mix through a real tritonserver
(the stand-in model on the CPU), every request answered with exactly its tokens, at each rate asked."""
from __future__ import annotations

import json
import subprocess
import sys

from bench.serve_bench import mix_requests
from scripts.tritonserver_env import REPO_ROOT


def test_open_loop_rates_through_tritonserver():
    num = 12
    cmd = [sys.executable, "-m", "bench.serve_bench", "--model", "stand-in", "--rates", "30,0.5x",
           "--mix-requests", str(num), "--decoding", "sampled", "--set", "device=cpu", "--set", "num_kv_blocks=2048"]
    done = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    prompts, params = mix_requests(num, "sampled")
    want_tokens = sum(p.max_tokens for p in params)
    assert result["decoding"] == "sampled" and result["slo_ms"] == [1000.0, 50.0]
    assert len(result["rates"]) == 2
    assert result["rates"][0]["rate"] == 30.0
    assert result["rates"][1]["rate"] == round(0.5 * result["engine"]["requests_per_s"], 3)
    for level in result["rates"]:
        assert level["requests"] == level["completed"] == num
        assert level["output_tokens"] == want_tokens  # EOS ignored: every request its drawn length
        assert 0 <= level["goodput_requests_per_s"] <= level["requests_per_s"]
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            assert set(level[key]) == {"mean", "p50", "p99"} and level[key]["p50"] <= level[key]["p99"]
