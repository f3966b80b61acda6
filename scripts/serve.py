"""`python -m scripts.serve`: start tritonserver on the Tandem model repository and say how to call it."""
from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
from pathlib import Path

from scripts.server_stop import wait_for_exit
from scripts.tritonserver_env import (REPO_ROOT, find_triton, make_model_repository, request_drain, start_server,
                                     stop_server, wait_until_ready)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    env = os.environ.get
    p = argparse.ArgumentParser(description=__doc__, epilog="Arguments after `--` go to tritonserver unchanged.")
    p.add_argument("--model-repository", default=env("TANDEM_MODEL_REPOSITORY", str(REPO_ROOT / "model_repository")))
    p.add_argument("--http-port", type=int, default=int(env("TANDEM_HTTP_PORT", "8000")))
    p.add_argument("--grpc-port", type=int, default=int(env("TANDEM_GRPC_PORT", "8001")))
    p.add_argument("--metrics-port", type=int, default=int(env("TANDEM_METRICS_PORT", "8002")))
    p.add_argument("--model-name", default="llm", help="model to wait for before printing the usage")
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for the model to load")
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config.pbtxt parameter (repeatable), e.g. --param model=random:llama-3-8b; "
                        "serves a temporary copy of the model repository")
    args, extra = p.parse_known_args(argv)
    args.extra = [a for a in extra if a != "--"]
    args.params = {}
    for item in args.param:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            p.error(f"--param takes KEY=VALUE, got {item!r}")
        args.params[key.strip()] = value.strip()
    return args


def usage(args: argparse.Namespace) -> str:
    name, http = args.model_name, args.http_port
    return f"""
Tandem is serving model '{name}'.
  HTTP     http://localhost:{http}   gRPC  localhost:{args.grpc_port}   metrics  http://localhost:{args.metrics_port}/metrics
  curl -s localhost:{http}/v2/models/{name}/generate \\
       -d '{{"text_input": "The capital of France is", "parameters": {{"max_tokens": 32, "temperature": 0}}}}'
  curl -sN localhost:{http}/v2/models/{name}/generate_stream \\
       -d '{{"text_input": "Write a haiku about GPUs", "stream": true, "parameters": {{"max_tokens": 64}}}}'
  python -m tandem_client "The capital of France is"
Ctrl-C stops the server.
"""


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.params:
        if Path(args.model_repository).resolve() != (REPO_ROOT / "model_repository").resolve():
            print("error: --param edits a copy of this repository's model_repository; edit your own "
                  f"{args.model_repository} instead", file=sys.stderr)
            return 2
        target = Path(tempfile.mkdtemp(prefix="tandem-serve-"))
        args.model_repository = str(make_model_repository(target, args.params, args.model_name))
        print(f"model repository: {args.model_repository} (parameters {args.params})", flush=True)
    install = find_triton()
    print(f"tritonserver: {install.binary}", flush=True)
    try:
        proc = start_server(
            args.model_repository, args.http_port, args.grpc_port, args.metrics_port, args.extra, install=install
        )
    except RuntimeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    # Ctrl-C / SIGTERM: ask Triton for an orderly shutdown (it unloads the model); a second one kills it.
    # The handler only signals: waiting here would race the main thread's wait_for_exit().
    signals = []

    def forward(signum, _frame):
        signals.append(signum)
        try:
            if len(signals) > 1:
                os.killpg(proc.pid, signal.SIGKILL)
            else:
                request_drain(proc)  # the model ends what still runs after its drain_timeout_s
                proc.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass

    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    try:
        wait_until_ready(proc, args.http_port, timeout=args.ready_timeout, model_name=args.model_name)
        print(usage(args), flush=True)
    except RuntimeError as err:
        print(f"error: {err}", file=sys.stderr)
        stop_server(proc)
        return 1
    code = wait_for_exit(proc)  # 0 also when the drain was over but Triton could not finish (server_stop.py)
    stop_server(proc)  # ends stubs the server left in its process group
    return code or 0


if __name__ == "__main__":
    sys.exit(main())
