"""`python -m loadtest.soak`: a long Locust run mixing normal streams, cancels and bad inputs; nothing may leak.

Starts its own tritonserver with the default model (unless --host is given), runs loadtest/soak_locustfile.py
headless, samples the Python-backend stub's RSS and the engine's gauges, then checks: zero unexpected failures,
stub RSS growth after warm-up under --max-rss-growth-pct, nothing running and no KV block in use at the end, the
server still ready. Writes out/soak/<time>/summary.json, resources.csv, rss.png and the load test's CSV/PNGs.
Exit status: 0 all criteria met, 1 a criterion missed, 2 the run could not happen.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from tandem_client import Client
from tandem_client.chat import CHATML
from tandem_client.urls import grpc_target
from loadtest.charts import write_all
from loadtest.prompts import DEFAULT_PROMPTS
from loadtest.report import read_csv, read_samples, summarize, table
from loadtest.run import LOCUST_GRACE_S, REPO_ROOT
from loadtest.server_metrics import ServerMetrics
from loadtest.soak_checks import ResourceSampler, criteria, rss_chart, rss_growth
from scripts import tritonserver_env as tse

SOAK_LOCUSTFILE = Path(__file__).with_name("soak_locustfile.py")
READY_TIMEOUT_S = 600.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtest.soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    p.add_argument("--users", type=int, default=12, help="concurrent users: 3/6 stream, 2/6 cancel, 1/6 bad input")
    p.add_argument("--spawn-rate", type=float, default=4.0)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompts", help="JSONL prompts (default: loadtest/prompts.jsonl without its long ones)")
    p.add_argument("--model", default="llm")
    p.add_argument("--host", help="gRPC server (host:port) to soak instead of starting one")
    p.add_argument("--http-host", help="its HTTP endpoint (http://host:port); default: derived, HTTP users on")
    p.add_argument("--metrics-url", help="its metrics endpoint; default: http://<host>:8002/metrics with --host")
    p.add_argument("--stub-marker", default="",
                   help="with --host: sample stubs whose command line contains this (e.g. the model repository)")
    p.add_argument("--grpc-only", action="store_true", help="no HTTP users")
    p.add_argument("--warmup", type=float, help="seconds before the RSS baseline (default: 10%% of --duration)")
    p.add_argument("--window", type=float, help="seconds each RSS floor spans (default: 10%% of --duration)")
    p.add_argument("--sample-interval", type=float, default=2.0, help="seconds between RSS/metrics samples")
    p.add_argument("--max-rss-growth-pct", type=float, default=5.0)
    p.add_argument("--idle-timeout", type=float, default=30.0, help="seconds for the server to go idle at the end")
    p.add_argument("--out", help="output folder (default: out/soak/<time>)")
    args = p.parse_args(argv)
    if args.duration <= 0 or args.users < 3 or args.spawn_rate <= 0:
        p.error("--duration and --spawn-rate must be positive, --users at least 3 (one of each kind)")
    args.warmup = args.duration * 0.1 if args.warmup is None else args.warmup
    args.window = args.duration * 0.1 if args.window is None else args.window
    args.out = Path(args.out or REPO_ROOT / "out" / "soak" / time.strftime("%Y%m%d-%H%M%S"))
    return args


class LocalServer:
    """A tritonserver on free ports serving a copy of our model repository (default settings) under `root`."""

    def __init__(self, root: Path):
        self.repo = tse.make_model_repository(root, {})
        self.http, self.grpc, self.metrics = tse.free_ports(3)
        self.log = root / "tritonserver.log"
        self.proc = None

    def __enter__(self) -> "LocalServer":
        args = ["--model-control-mode=explicit", "--load-model=llm", "--exit-timeout-secs=30"]
        self.proc = tse.start_server(self.repo, self.http, self.grpc, self.metrics, args, log_path=self.log)
        try:
            tse.wait_until_ready(self.proc, self.http, timeout=READY_TIMEOUT_S, model_name="llm")
        except RuntimeError:
            tse.stop_server(self.proc)
            raise
        return self

    def __exit__(self, *exc) -> None:
        tse.stop_server(self.proc)

    def stub_pids(self) -> list[int]:
        return tse.stub_pids(str(self.repo))


def default_prompts(out: Path) -> Path:
    """Short and medium prompts: long ones make every CPU step a multi-second prefill (the soak is about leaks)."""
    rows = [json.loads(line) for line in DEFAULT_PROMPTS.read_text(encoding="utf-8").splitlines() if line.strip()]
    path = out / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows if r.get("kind") != "long"), encoding="utf-8")
    return path


def locust_command(args: argparse.Namespace, out: Path) -> list[str]:
    cmd = [
        sys.executable, "-m", "locust", "-f", str(SOAK_LOCUSTFILE), "--headless", "--only-summary",
        "--users", str(args.users), "--spawn-rate", str(args.spawn_rate), "--run-time", f"{int(round(args.duration))}s",
        "--host", args.host, "--csv", str(out / "locust"), "--csv-full-history", "--loglevel", "WARNING",
        # sampled, not greedy: varied texts and lengths, as real traffic
        "--protocol", "grpc", "--model", args.model, "--max-tokens", str(args.max_tokens), "--temperature", "0.7",
        "--prompts", args.prompts, "--samples-file", str(out / "samples.jsonl"),
        "--events-file", str(out / "events.jsonl"),
        # ChatML, the default model's template without its system line: without it SmolLM2-Instruct mostly answers
        # a raw prompt with EOS at once, and the soak would hardly decode
        "--tokenizer", CHATML,
    ]
    return cmd + ([] if args.grpc_only else ["--http-host", args.http_host])


def run_locust(cmd: list[str], log: Path, duration: float) -> tuple[int | None, bool]:
    """Locust in a subprocess (importing it here would gevent-patch this process); (exit code, hung).

    One that does not stop within LOCUST_GRACE_S of the run time gets SIGUSR1 first: soak_locustfile then
    writes every greenlet's stack into the log, so the hang can be diagnosed; then it is killed.
    """
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
        try:
            return proc.wait(timeout=duration + LOCUST_GRACE_S), False
        except subprocess.TimeoutExpired:
            print(f"warning: locust did not stop within {LOCUST_GRACE_S} s of its run time; stacks in {log}",
                  file=sys.stderr)
            proc.send_signal(signal.SIGUSR1)
            time.sleep(3)
            return None, True
        finally:
            if proc.poll() is None:  # hung, or we were interrupted: never leave Locust loading the server
                proc.kill()
                proc.wait()


def end_state(metrics: ServerMetrics, timeout: float) -> dict:
    """After the load: how long until nothing runs or waits and no KV block is held, and the last figures."""
    try:
        took, snap = metrics.wait_idle(timeout)
    except OSError as err:
        return {"idle_after_s": None, "kv_blocks_used": None, "error": f"metrics endpoint: {err}"}
    return {"idle_after_s": took, **snap}


def health(args: argparse.Namespace) -> dict:
    """Still ready, and a normal request still gets a normal answer."""
    try:
        with Client(args.host, "grpc", args.model, timeout=60) as client:
            ready = client.is_ready()
            result = client.generate("The capital of France is", max_tokens=8, temperature=0.0)
        ok = ready and result.num_output_tokens > 0 and result.finish_reason in ("length", "stop")
        return {"ready": ok, "text": result.text, "finish_reason": result.finish_reason}
    except Exception as err:  # noqa: BLE001 — any failure here is the finding itself
        return {"ready": False, "error": repr(err)}


def count_events(out: Path) -> dict[str, int]:
    rows = read_samples(out / "events.jsonl")
    return {"cancelled": sum(r["kind"] == "cancel" for r in rows),
            "bad_input_refused": sum(r["kind"] == "bad_input" for r in rows)}


def soak(args: argparse.Namespace, stub_pids, server_pid: int | None) -> dict:
    """Run the load with the sampler on; return the summary (criteria included)."""
    metrics = ServerMetrics(args.metrics_url, args.model)
    sampler = ResourceSampler(stub_pids, server_pid, metrics, args.sample_interval)
    print(f"soak: {args.duration:.0f} s, {args.users} users against {args.host} (+ {args.http_host}); "
          f"out {args.out}", flush=True)
    sampler.start()
    code, hung = run_locust(locust_command(args, args.out), args.out / "locust.log", args.duration)
    sampler.stop()
    sampler.write_csv(args.out / "resources.csv")
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    settings["prompt_format"] = f"chat template ({CHATML})"
    normal = summarize(args.out / "locust", args.out / "samples.jsonl", settings)
    summary = {
        "settings": settings, "locust_exit_code": code, "locust_hung_at_stop": hung,
        "normal": {k: v for k, v in normal.items() if k != "settings"},
        "counts": {"normal": normal["requests"], **count_events(args.out)}, "failures": normal["failures"],
        "rss": rss_growth(sampler.samples, args.warmup, args.window), "stub_pids": sorted(sampler.pids_seen),
        "end_state": end_state(metrics, args.idle_timeout), "health": health(args),
    }
    rss_optional = bool(args.remote and not args.stub_marker)  # a remote server's stub is not ours to sample
    summary["criteria"] = criteria(summary, args.max_rss_growth_pct, rss_optional)
    summary["passed"] = all(c["passed"] is not False for c in summary["criteria"].values())
    write_all(read_csv(args.out / "locust_stats_history.csv"), normal, args.out, read_samples(args.out / "samples.jsonl"))
    rss_chart(sampler.samples, args.warmup, args.out / "rss.png", summary["rss"])
    return summary


def report(summary: dict) -> str:
    c, rss, end = summary["counts"], summary["rss"], summary["end_state"]
    lines = [table(summary["normal"]),
             f"normal {c['normal']}   cancelled {c['cancelled']}   bad inputs refused {c['bad_input_refused']}   "
             f"unexpected failures {summary['failures']['count']}"]
    if rss.get("measured"):
        lines.append(f"stub RSS: after warm-up {rss['after_warmup_mb']:.1f} MiB, end {rss['end_mb']:.1f} MiB, "
                     f"growth {rss['growth_pct']:+.2f}% (peak {rss['peak_mb']:.1f} MiB)")
    lines.append(f"end: idle after {end.get('idle_after_s')} s, KV blocks used {end.get('kv_blocks_used')}")
    verdict = {True: "pass", False: "MISSED", None: "skipped"}
    lines += [f"{verdict[v['passed']]}  {k}: {v['measured']} (target {v['target']})"
              for k, v in summary["criteria"].items()]
    return "\n".join(lines)


def target(args: argparse.Namespace, stack: contextlib.ExitStack):
    """Fill in the endpoints; start our own server unless --host is given. Returns (stub_pids(), server pid)."""
    args.remote = bool(args.host)
    if args.remote:
        host = grpc_target(args.host).rsplit(":", 1)[0]  # Triton's default ports for the other endpoints
        args.http_host = args.http_host or f"http://{host}:8000"
        args.metrics_url = args.metrics_url or f"http://{host}:8002/metrics"
        return (lambda: tse.stub_pids(args.stub_marker)) if args.stub_marker else (lambda: []), None
    server = stack.enter_context(LocalServer(args.out))
    args.host, args.http_host = f"localhost:{server.grpc}", f"http://localhost:{server.http}"
    args.metrics_url = f"http://localhost:{server.metrics}/metrics"
    return server.stub_pids, server.proc.pid


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    args.prompts = args.prompts or str(default_prompts(args.out))
    with contextlib.ExitStack() as stack:
        try:
            stub_pids, server_pid = target(args, stack)
        except (RuntimeError, FileNotFoundError) as err:
            print(f"error: could not start tritonserver: {err} (log: {args.out / 'tritonserver.log'})", file=sys.stderr)
            return 2
        with Client(args.host, "grpc", args.model) as client:
            if not client.is_ready():
                print(f"error: model '{args.model}' is not ready at {args.host}", file=sys.stderr)
                return 2
        summary = soak(args, stub_pids, server_pid)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(report(summary))
    print(f"wrote {args.out}/summary.json, resources.csv, rss.png, locust_*.csv and charts")
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
