"""`python -m loadtest.run`: run Locust headless against a Triton LLM model, then summarise and chart it.

The protocol comes from --host's scheme (http://host:port → HTTP; grpc://host:port or host:port → gRPC).
Prompts go in the model's chat template unless --raw-prompts (raw prompts at temperature 0 often end after one
token); the summary says which, and how many requests decoded enough to give an inter-token latency.
Exit status: 0 all good, 1 failures (ours or Locust's count) or a missed SLO, 2 the run could not happen (bad
settings, server unreachable or not ready, Locust error).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from tandem_client import Client, GenerateRequest, TandemError
from tandem_client.chat import load_template
from tandem_client.urls import DEFAULT_URLS, resolve
from loadtest.charts import write_all
from loadtest.prompts import DEFAULT_PROMPTS
from loadtest.report import read_csv, read_samples, summarize, table
from loadtest.server_watch import ServerWatch

LOCUSTFILE = Path(__file__).with_name("locustfile.py")
REPO_ROOT = LOCUSTFILE.parent.parent
LOCUST_GRACE_S = 120  # start-up and shutdown on top of --duration
EXIT_FAILED, EXIT_NOT_RUN = 1, 2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtest.run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--users", type=int, default=8, help="concurrent streams (closed loop)")
    p.add_argument("--spawn-rate", type=float, default=8.0, help="users started per second")
    p.add_argument("--duration", type=float, default=60.0, help="seconds")
    p.add_argument("--host", help="server: http://host:port for HTTP, host:port or grpc://host:port for gRPC "
                                  f"(default: {DEFAULT_URLS['grpc']}, gRPC)")
    p.add_argument("--protocol", choices=("grpc", "http"),
                   help="default: the --host scheme's, else grpc; one that contradicts the scheme is an error")
    p.add_argument("--model", default="llm")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--ignore-eos", action="store_true", help="every request generates exactly --max-tokens")
    p.add_argument("--raw-prompts", action="store_true", help="send the prompts as they are (default: in the chat "
                                                                 "template of --tokenizer)")
    p.add_argument("--tokenizer", help="model folder or .gguf whose chat template wraps the prompts, or 'chatml' "
                                       "(default: the engine's default model's, else ChatML)")
    p.add_argument("--no-stats", action="store_true", help="do not send return_* inputs (models without them)")
    p.add_argument("--prompts", default=str(DEFAULT_PROMPTS))
    p.add_argument("--out", help="output folder (default: out/loadtest/<time>)")
    p.add_argument("--slo-ttft-p95-ms", type=float)
    p.add_argument("--slo-itl-p95-ms", type=float)
    p.add_argument("--metrics-url", help="the server's Prometheus endpoint (e.g. http://localhost:8002/metrics): "
                                         "the summary adds its GPU busy, KV usage, queue and token figures")
    args = p.parse_args(argv)
    if args.users < 1 or args.duration <= 0 or args.spawn_rate <= 0:
        p.error("--users, --duration and --spawn-rate must be positive")
    try:
        GenerateRequest(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p)
        args.protocol, args.host = resolve(args.host, args.protocol)
    except ValueError as err:
        p.error(str(err))
    args.out = Path(args.out or REPO_ROOT / "out" / "loadtest" / time.strftime("%Y%m%d-%H%M%S"))
    return args


def locust_command(args: argparse.Namespace, prefix: Path, samples: Path) -> list[str]:
    cmd = [
        sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--only-summary",
        "--users", str(args.users), "--spawn-rate", str(args.spawn_rate), "--run-time", f"{int(round(args.duration))}s",
        "--host", args.host, "--csv", str(prefix), "--csv-full-history", "--loglevel", "WARNING",
        "--protocol", args.protocol, "--model", args.model, "--max-tokens", str(args.max_tokens),
        "--temperature", str(args.temperature), "--top-p", str(args.top_p), "--prompts", args.prompts,
        "--samples-file", str(samples),
    ]
    cmd += ["--raw-prompts"] if args.raw_prompts else ["--tokenizer", args.tokenizer]
    return cmd + (["--ignore-eos"] if args.ignore_eos else []) + (["--no-stats"] if args.no_stats else [])


def run_locust(cmd: list[str], log: Path, duration: float) -> int:
    """Locust in a subprocess: importing it here would gevent-patch this process."""
    with log.open("w") as f:
        try:
            return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                                  timeout=duration + LOCUST_GRACE_S).returncode
        except subprocess.TimeoutExpired:  # subprocess.run has already killed it
            print(f"error: locust did not stop within {LOCUST_GRACE_S} s of --duration", file=sys.stderr)
            return -1


def settings(args: argparse.Namespace) -> dict:
    keys = ("users", "spawn_rate", "duration", "protocol", "host", "model", "max_tokens", "temperature",
            "top_p", "ignore_eos", "prompts", "prompt_format")
    return {k: getattr(args, k) for k in keys}


def choose_template(args: argparse.Namespace) -> None:
    """Settle the chat template here, once, so the summary can name it and Locust need not look for it again."""
    if args.raw_prompts:
        args.prompt_format = "raw"
        return
    template, note = load_template(args.tokenizer)
    if note:
        print(f"note: {note}", file=sys.stderr)
    args.tokenizer = template.origin  # a folder, a .gguf or "chatml": what the Locust process loads
    args.prompt_format = f"chat template ({template.origin})"


def check_server(args: argparse.Namespace) -> str | None:
    """None when the model is ready; else what is wrong, naming the protocol and port."""
    try:
        with Client(args.host, args.protocol, args.model) as client:
            client.check_ready()
    except TandemError as err:
        return err.message
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    problem = check_server(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return EXIT_NOT_RUN
    choose_template(args)
    args.out.mkdir(parents=True, exist_ok=True)
    prefix, samples, log = args.out / "locust", args.out / "samples.jsonl", args.out / "locust.log"
    samples.unlink(missing_ok=True)
    print(f"load test: {json.dumps(settings(args))}", flush=True)
    watch = ServerWatch(args.metrics_url, args.model).start() if args.metrics_url else None
    code = run_locust(locust_command(args, prefix, samples), log, args.duration)
    server = watch.stop() if watch else None
    if code == EXIT_NOT_RUN or not Path(f"{prefix}_stats.csv").exists():
        print(f"error: locust exited with {code}; see {log}:\n{log.read_text()[-2000:]}", file=sys.stderr)
        return EXIT_NOT_RUN
    summary = summarize(prefix, samples, settings(args), args.slo_ttft_p95_ms, args.slo_itl_p95_ms)
    summary["locust_exit_code"] = code
    if code != 0:  # Locust counted a failure (or a user crashed) that the samples may not show
        summary["passed"] = False
    if server is not None:
        summary["server"] = server
        print(f"server: {json.dumps(server)}")
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    charts = write_all(read_csv(Path(f"{prefix}_stats_history.csv")), summary, args.out, read_samples(samples))
    print(table(summary))
    print(json.dumps({k: summary.get(k) for k in ("requests", "requests_per_s", "output_tokens_per_s")}
                     | {"failures": summary["failures"]["count"], "locust_exit_code": code,
                        "passed": summary["passed"]}))
    print(f"wrote {args.out}/summary.json, locust_*.csv, " + ", ".join(p.name for p in charts))
    return 0 if summary["passed"] else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
