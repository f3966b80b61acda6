"""Helpers for tests that start their own tritonserver: concurrent greedy requests, per-instance counters."""
from __future__ import annotations

import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from loadtest.server_metrics import ServerMetrics


def greedy_texts(http_port: int, prompt: str, max_tokens: int, count: int, workers: int) -> list[str]:
    """text_output of `count` greedy HTTP generate requests, `workers` at a time."""
    body = json.dumps({"text_input": prompt,
                       "parameters": {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}}).encode()

    def ask(_):
        req = urllib.request.Request(f"http://localhost:{http_port}/v2/models/llm/generate", data=body)
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.load(r)["text_output"]

    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(ask, range(count)))


def finished_per_instance(metrics_port: int, expected_total: int, timeout: float = 10.0) -> dict[str, float]:
    """tandem_requests_total added up over finish reasons, per instance label, once the total reaches
    expected_total or the timeout passes (the counters move on the sender thread, after the responses)."""
    def counts() -> dict[str, float]:
        out: dict[str, float] = {}
        for name, labels, value in ServerMetrics(f"http://localhost:{metrics_port}/metrics").scrape():
            if name == "tandem_requests_total":
                out[labels.get("instance", "")] = out.get(labels.get("instance", ""), 0.0) + value
        return out

    deadline = time.monotonic() + timeout
    got = counts()
    while sum(got.values()) < expected_total and time.monotonic() < deadline:
        time.sleep(0.2)
        got = counts()
    return got
