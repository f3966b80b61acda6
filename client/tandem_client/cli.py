"""`python -m tandem_client "prompt"`: stream an answer from a Triton LLM model to the terminal."""
from __future__ import annotations

import argparse
import json
import sys
import time

from tandem_client.client import Client
from tandem_client.collect import Collector
from tandem_client.errors import TandemConnectionError, TandemError
from tandem_client.schema import GenerateRequest
from tandem_client.urls import DEFAULT_URLS, PROTOCOLS, resolve

EXIT_SERVER_ERROR, EXIT_USAGE, EXIT_UNREACHABLE, EXIT_INTERRUPTED = 1, 2, 3, 130


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tandem_client", description=__doc__)
    p.add_argument("prompt", nargs="?", help="the prompt; '-' or nothing reads it from stdin")
    p.add_argument("--url", help="server address: http://host:port means HTTP, grpc://host:port or host:port gRPC "
                   f"(default: grpc {DEFAULT_URLS['grpc']}, http http://{DEFAULT_URLS['http']})")
    p.add_argument("--model", default="llm", help="Triton model name (default: llm)")
    p.add_argument("--protocol", choices=PROTOCOLS, help="default: the --url scheme's, else grpc; "
                   "one that contradicts the scheme is an error")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, help="0 = greedy (server default when omitted)")
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="generate exactly --max-tokens tokens")
    p.add_argument("--no-stream", action="store_true", help="ask for the whole answer in one response")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--system", help="system message for --chat")
    p.add_argument("--tokenizer", help="local model folder or .gguf whose chat template --chat uses, or 'chatml' "
                   "(default: the engine's default model)")
    p.add_argument("--json", action="store_true", help="machine output: one JSON object per line")
    p.add_argument("--timeout", type=float, help="seconds to wait for each response")
    p.add_argument("-v", "--verbose", action="store_true", help="print timings and token counts to stderr")
    return p.parse_args(argv)


def build_request(args: argparse.Namespace, prompt: str) -> GenerateRequest:
    if args.chat:
        from tandem_client.chat import load_template

        template, note = load_template(args.tokenizer)
        if note:
            print(f"note: {note}", file=sys.stderr)
        prompt = template.render(prompt, args.system)
    return GenerateRequest(
        prompt=prompt, max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos, stream=not args.no_stream,
    )


def read_prompt(args: argparse.Namespace) -> str:
    if args.prompt not in (None, "-"):
        return args.prompt
    if sys.stdin.isatty():
        raise SystemExit("error: give a prompt, e.g. python -m tandem_client \"The capital of France is\"")
    return sys.stdin.read()


def run(client: Client, req: GenerateRequest, as_json: bool, out=sys.stdout):
    """Print each chunk as it arrives; returns the folded Result."""
    collector = Collector()
    for chunk in client.stream(req):
        collector.add(chunk)
        if as_json and req.stream:
            out.write(json.dumps({"type": "chunk", **chunk.to_dict()}) + "\n")
        elif not as_json:
            out.write(chunk.text)
        out.flush()
    result = collector.result()
    out.write(json.dumps({"type": "result", **result.to_dict()}) + "\n" if as_json else "\n")
    return result


def summary(result) -> str:
    rate = result.num_output_tokens / result.e2e_s if result.e2e_s else 0.0
    ttft = f"{result.ttft_s * 1000:.0f} ms" if result.ttft_s is not None else "-"
    return (f"[{result.num_output_tokens} tokens, finish: {result.finish_reason}, ttft {ttft}, "
            f"total {result.e2e_s or 0:.2f} s, {rate:.1f} tok/s]")


def report_error(err: TandemError, args: argparse.Namespace) -> int:
    if args.json:
        print(json.dumps({"type": "error", "status": err.status, "message": err.message}), flush=True)
    if isinstance(err, TandemConnectionError):
        print(f"error: {err.message}", file=sys.stderr)
        return EXIT_UNREACHABLE
    print(f"error: server said {err}", file=sys.stderr)
    return EXIT_SERVER_ERROR


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        args.protocol, args.url = resolve(args.url, args.protocol)
        req = build_request(args, read_prompt(args))
    except (TypeError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    started = time.perf_counter()
    try:
        with Client(args.url, args.protocol, args.model, args.timeout) as client:
            result = run(client, req, args.json)
    except TandemError as err:
        return report_error(err, args)
    except KeyboardInterrupt:  # the stream's own cleanup has already cancelled the request on the server
        print("\ninterrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    if args.verbose:
        print(summary(result) + f" wall {time.perf_counter() - started:.2f} s", file=sys.stderr)
    return 0
