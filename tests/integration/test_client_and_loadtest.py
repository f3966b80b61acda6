"""The client library, its CLI and the load test against a real tritonserver (the `triton_server` fixture)."""
from __future__ import annotations

import asyncio
import csv
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from tandem_client import AsyncClient, Client, TandemError

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
PROTOCOLS = ("grpc", "http")
PROMPT = "The capital of France is"


def url(server, protocol: str) -> str:
    return server.grpc_url if protocol == "grpc" else server.http_url


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tandem_client", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_cli_streams_an_answer(triton_server, protocol):
    target = ["--url", url(triton_server, protocol), "--protocol", protocol, "--model", triton_server.model_name]
    proc = run_cli(PROMPT, *target, "--max-tokens", "8", "--temperature", "0", "--json")
    assert proc.returncode == 0, proc.stderr + triton_server.log_tail()
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    chunks, result = [x for x in lines if x["type"] == "chunk"], lines[-1]
    assert result["type"] == "result" and len(chunks) >= 2  # streamed, not one blob
    assert result["text"].strip() and 0 < result["num_output_tokens"] <= 8
    assert result["text"] == "".join(c["text"] for c in chunks)
    assert result["finish_reason"] in ("length", "stop")
    plain = run_cli(PROMPT, *target, "--max-tokens", "8", "--temperature", "0")
    assert plain.returncode == 0 and plain.stdout.strip() == result["text"].strip()
    if protocol == "http":  # the scheme alone picks HTTP; a bare host:port means gRPC
        by_scheme = run_cli(PROMPT, "--url", f"http://{triton_server.http_url}", "--model", triton_server.model_name,
                            "--max-tokens", "8", "--temperature", "0")
        assert by_scheme.returncode == 0 and by_scheme.stdout == plain.stdout, by_scheme.stderr
    else:  # gRPC to the HTTP port, the old trap: the message says what the port speaks
        http = triton_server.http_url
        wrong = run_cli(PROMPT, "--url", http, "--max-tokens", "2")
        expected = (f"cannot reach Triton over gRPC at {http}: port {http.rsplit(':', 1)[1]} answers, but not in gRPC: "
                    f"an HTTP port? for HTTP use http://{http}")
        assert wrong.returncode == 3 and expected in wrong.stderr, wrong.stderr


def test_sync_async_grpc_http_give_the_same_greedy_text(triton_server):
    params = dict(max_tokens=12, temperature=0.0)
    texts = {}
    for protocol in PROTOCOLS:
        with Client(url(triton_server, protocol), protocol, triton_server.model_name) as client:
            texts[f"{protocol}-sync"] = client.generate(PROMPT, **params).text
            texts[f"{protocol}-sync-nostream"] = client.generate(PROMPT, stream=False, **params).text

        async def agenerate():
            async with AsyncClient(url(triton_server, protocol), protocol, triton_server.model_name) as client:
                return await client.generate(PROMPT, **params)

        result = asyncio.run(agenerate())
        texts[f"{protocol}-async"] = result.text
        assert result.num_output_tokens > 0 and result.ttft_s is not None
    assert len(set(texts.values())) == 1, texts
    assert next(iter(texts.values())).strip()


def in_flight(metrics_url: str) -> float | None:
    """Running + waiting requests from the model's gauges; None when the server exports no such gauges."""
    text = requests.get(metrics_url, timeout=5).text
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(("tandem_num_requests_running{", "tandem_num_requests_waiting{"))]
    return sum(values) if values else None


def wait_in_flight(metrics_url: str, busy: bool, timeout: float = 10.0) -> float | None:
    """Poll until the gauges say busy (>0) or idle (0); they refresh on an interval, so never trust one read."""
    deadline = time.monotonic() + timeout
    while (n := in_flight(metrics_url)) is not None and bool(n) != busy and time.monotonic() < deadline:
        time.sleep(0.1)
    return n


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_cancel_mid_stream_then_serve_again(triton_server, protocol):
    with Client(url(triton_server, protocol), protocol, triton_server.model_name) as client:
        stream = client.stream("Tell me a very long story.", max_tokens=1000, ignore_eos=True, temperature=0.0)
        got = [next(stream), next(stream)]
        wait_in_flight(triton_server.metrics_url, busy=True)
        started = time.perf_counter()
        stream.close()  # caller stops reading: the client cancels the request
        assert time.perf_counter() - started < 5.0
        assert all(not c.final for c in got)
        # 1,000 tokens take far longer than this on a CPU: an idle engine means the server really stopped it
        assert wait_in_flight(triton_server.metrics_url, busy=False) in (0, None), triton_server.log_tail()
        after = client.generate(PROMPT, max_tokens=4, temperature=0.0)  # the server is fine and free
        assert after.num_output_tokens > 0


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_async_break_cancels(triton_server, protocol):
    async def scenario():
        async with AsyncClient(url(triton_server, protocol), protocol, triton_server.model_name) as client:
            n = 0
            async for _ in client.stream("Count to one thousand.", max_tokens=1000, ignore_eos=True):
                n += 1
                if n == 2:
                    break
            return await client.generate(PROMPT, max_tokens=4, temperature=0.0)

    assert asyncio.run(asyncio.wait_for(scenario(), 60)).num_output_tokens > 0


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_server_errors_become_tandem_error(triton_server, protocol):
    with Client(url(triton_server, protocol), protocol, triton_server.model_name) as client:
        with pytest.raises(TandemError) as info:
            client.generate(PROMPT, extra={"max_tokens": -1})  # bypasses the client's own check
    assert info.value.message
    if protocol == "http":
        assert info.value.http_status == 400 and info.value.status == "INVALID_ARG"


def short_prompts(tmp_path: Path) -> Path:
    """Short and medium prompts only: a CPU-sized server (max_model_len 1024, 2 cores) in ~10 s."""
    rows = [json.loads(line) for line in (REPO / "loadtest" / "prompts.jsonl").read_text().splitlines()]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows if r["kind"] != "long"))
    return path


@pytest.mark.parametrize("protocol,duration", [("grpc", 10), ("http", 6)])
def test_loadtest_runner_headless(triton_server, tmp_path, protocol, duration):
    out = tmp_path / "out"
    # no --protocol: the host's form decides (host:port gRPC, http://host:port HTTP)
    host = url(triton_server, protocol) if protocol == "grpc" else f"http://{triton_server.http_url}"
    # gRPC: the defaults (prompts in the default model's chat template, EOS honoured) must decode; HTTP: ignore_eos
    # and ChatML, so every request decodes all its tokens
    decoding = [] if protocol == "grpc" else ["--ignore-eos", "--tokenizer", "chatml"]
    max_tokens = "8"  # short requests finish within the run even on a busy CPU (~0.2 s a step)
    proc = subprocess.run(
        [sys.executable, "-m", "loadtest.run", "--users", "4", "--spawn-rate", "4", "--duration", str(duration),
         "--host", host, "--model", triton_server.model_name, "--max-tokens", max_tokens, *decoding,
         "--prompts", str(short_prompts(tmp_path)), "--out", str(out), "--metrics-url", triton_server.metrics_url],
        cwd=REPO, capture_output=True, text=True, timeout=duration + 180)
    log = (out / "locust.log").read_text() if (out / "locust.log").exists() else ""
    assert proc.returncode == 0, proc.stdout + proc.stderr + log
    summary = json.loads((out / "summary.json").read_text())
    assert summary["settings"]["protocol"] == protocol and summary["locust_exit_code"] == 0
    assert summary["failures"]["count"] == 0 and summary["requests"] > 0
    assert summary["ttft_ms"]["p50"] > 0 and summary["itl_ms"]["p50"] > 0 and summary["output_tokens_per_s"] > 0
    d = summary["decoding"]
    assert d["prompt_format"].startswith("chat template (") and d["ignore_eos"] == (protocol == "http")
    # decoding, not prefill: most requests give an inter-token latency
    assert d["requests_with_itl"] >= 0.8 * summary["requests"] and d["one_token_or_less"] <= 0.2 * summary["requests"]
    assert "decoding: prompts chat template" in proc.stdout
    with (out / "locust_stats.csv").open() as f:
        rows = list(csv.DictReader(f))
    counts = {row["Name"]: int(row["Request Count"]) for row in rows}
    assert counts.get("ttft", 0) > 0 and counts.get("itl", 0) > 0 and counts.get("e2e", 0) > 0
    assert {row["Type"] for row in rows if row["Name"] == "e2e"} == {protocol}
    assert (out / "locust_stats_history.csv").exists()
    for png in ("throughput.png", "latency_over_time.png", "latency_percentiles.png"):
        assert (out / png).stat().st_size > 1000, png
    server = summary["server"]  # the server's own view of the same window (--metrics-url)
    assert server["samples"] >= 3 and "scrape_errors" not in server, server
    # completed requests' tokens and those of requests cut off at the stop; the server may have made a few more
    # that no client read before the stop
    seen = summary["requests"] * summary["output_tokens_mean"] + summary["in_flight_at_stop"]["output_tokens"]
    assert server["generated_tokens"] >= seen - 0.5, (server, summary["in_flight_at_stop"])
    assert 1 <= server["running"]["max"] <= 4 and server["preemptions"] == 0, server
