"""Locust users that stream from a Triton LLM model and report ttft / itl / e2e as separate entries.

    locust -f loadtest/locustfile.py --host http://localhost:8000 --max-tokens 128   # HTTP: the scheme decides
    locust -f loadtest/locustfile.py --host localhost:8001                           # gRPC (or grpc://host:port)
Custom options (also as environment variables LOADTEST_*): --protocol, --model, --max-tokens, --temperature,
--top-p, --ignore-eos, --raw-prompts, --tokenizer, --prompts, --samples-file, --no-stats.
Prompts go in the model's chat template unless --raw-prompts: a raw prompt at temperature 0 often ends after one
token, and then the run measures prefill, not decoding. Exit status: Locust's (1 when a request failed), or 2 when
the settings are wrong or the server cannot be reached at the start (headless runs).
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import random
import sys
import time

import gevent
import grpc.experimental.gevent as grpc_gevent
from gevent import GreenletExit
from locust import User, constant, events, task  # importing locust monkey-patches this process with gevent

from tandem_client import Client, GenerateRequest, TandemConnectionError, TandemError
from tandem_client.chat import ChatTemplate, load_template
from tandem_client.collect import Collector
from tandem_client.urls import resolve
from loadtest.backoff import Backoff
from loadtest.metrics import E2E, entries, failure_sample, sample, stopped_sample
from loadtest.prompts import DEFAULT_PROMPTS, load_prompts

# grpcio's own threads must yield to gevent; this has to run before any channel exists (users make them).
grpc_gevent.init_gevent()

ERROR_BACKOFF_S = 0.1
EXIT_REFUSED = 2
_prompts: list[str] = []
_chat: ChatTemplate | None = None
_target: tuple[str, str] | None = None  # (protocol, address), set once the settings and the server check out
_samples_file = None


@events.init_command_line_parser.add_listener
def add_options(parser):
    parser.add_argument("--protocol", choices=["grpc", "http"], default=None, env_var="LOADTEST_PROTOCOL",
                        help="default: the --host scheme's (http:// → HTTP), else gRPC; one that contradicts the "
                             "scheme is an error")
    parser.add_argument("--model", default="llm", env_var="LOADTEST_MODEL", help="Triton model name")
    parser.add_argument("--max-tokens", type=int, default=128, env_var="LOADTEST_MAX_TOKENS")
    parser.add_argument("--temperature", type=float, default=0.0, env_var="LOADTEST_TEMPERATURE")
    parser.add_argument("--top-p", type=float, default=1.0, env_var="LOADTEST_TOP_P")
    parser.add_argument("--ignore-eos", action="store_true", env_var="LOADTEST_IGNORE_EOS",
                        help="every request generates exactly --max-tokens tokens")
    parser.add_argument("--raw-prompts", action="store_true", env_var="LOADTEST_RAW_PROMPTS",
                        help="send the prompts as they are (default: in the model's chat template)")
    parser.add_argument("--tokenizer", default="", env_var="LOADTEST_TOKENIZER",
                        help="model folder or .gguf whose chat template wraps the prompts, or 'chatml' "
                             "(default: the engine's default model's template, else ChatML)")
    parser.add_argument("--prompts", default=str(DEFAULT_PROMPTS), env_var="LOADTEST_PROMPTS")
    parser.add_argument("--samples-file", default="", env_var="LOADTEST_SAMPLES_FILE",
                        help="append one JSON line of exact timings per request here")
    parser.add_argument("--no-stats", action="store_true", env_var="LOADTEST_NO_STATS",
                        help="do not send the optional return_* inputs (models that lack them)")


def refuse(environment, message: str) -> None:
    """Stop before any user starts: a bad setting or an absent server would fail every request in a tight loop."""
    logging.error(message)
    if environment.parsed_options.headless:
        environment.process_exit_code = EXIT_REFUSED
        gevent.spawn(environment.runner.quit)  # quit after start() returns; quitting inside it is ignored
    else:
        gevent.spawn(environment.runner.stop)  # the web UI stays up and shows the log


@events.test_start.add_listener
def on_test_start(environment, **_):
    global _samples_file, _chat, _target
    opts = environment.parsed_options
    try:
        protocol, address = resolve(environment.host, opts.protocol)
        _prompts[:] = load_prompts(opts.prompts)
        GenerateRequest(max_tokens=opts.max_tokens, temperature=opts.temperature, top_p=opts.top_p)
    except (OSError, ValueError) as err:
        refuse(environment, f"load test settings: {err}")
        return
    try:
        with Client(address, protocol, opts.model) as client:
            client.check_ready()
    except TandemError as err:
        refuse(environment, f"load test: {err.message}")
        return
    if not opts.raw_prompts:
        _chat, note = load_template(opts.tokenizer or None)
        if note:
            logging.warning("load test: %s", note)
    path = opts.samples_file
    if path:
        _samples_file = open(path, "a", buffering=1, encoding="utf-8")  # line-buffered: one write per sample
    _target = protocol, address


def target() -> tuple[str, str]:
    """(protocol, address) the run settled on. After a refused start Locust still spawns its users: they wait
    here until the quit stops them, sending nothing and logging nothing."""
    while _target is None:
        gevent.sleep(1.0)
    return _target


@events.test_stop.add_listener
def on_test_stop(environment, **_):
    if _samples_file is not None:
        _samples_file.flush()


def _exit_now(code: int) -> None:
    """Leave before grpcio's own exit handlers: under gevent, closing a channel at interpreter exit can block
    forever (seen with py-spy), and Locust would never return. Stats and CSVs are written by then."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


@events.quit.add_listener
def exit_with_locusts_code(exit_code: int, **_):
    """Locust fires `quit` with the exit code it settled on (failures included), just before sys.exit(code);
    registered now, after grpc's import, the handler runs before grpc's (atexit is LIFO). An earlier exit (a bad
    command line) never gets here and keeps its own code."""
    atexit.register(_exit_now, exit_code)


def _record(row: dict) -> None:
    if _samples_file is not None:
        _samples_file.write(json.dumps(row) + "\n")


class LLMUser(User):
    """Sends one streaming generation at a time, back to back (closed loop: concurrency = users)."""

    wait_time = constant(0)

    def on_start(self):
        self.protocol, address = target()
        self.client = Client(address, self.protocol, self.environment.parsed_options.model)
        self.rng = random.Random()
        self.backoff = Backoff()

    def on_stop(self):
        if getattr(self, "client", None) is not None:  # None: stopped before on_start made one
            self.client.close()

    def request(self) -> GenerateRequest:
        opts = self.environment.parsed_options
        prompt = self.rng.choice(_prompts)
        return GenerateRequest(
            prompt=prompt if _chat is None else _chat.render(prompt), max_tokens=opts.max_tokens,
            temperature=opts.temperature, top_p=opts.top_p, ignore_eos=opts.ignore_eos, return_stats=not opts.no_stats,
        )

    @task
    def generate(self):
        start_unix = time.time()
        collector = Collector()
        try:
            req = self.request()
            for chunk in self.client.stream(req):
                collector.add(chunk)
        except GreenletExit:  # the run ended mid-request (Locust kills its users): its tokens so far still count
            elapsed_ms = (time.perf_counter() - collector.start) * 1000.0
            _record(stopped_sample(collector.result(), start_unix, self.protocol, elapsed_ms))
            raise
        except Exception as err:  # noqa: BLE001 — every failure is a Locust failure, never a crashed user
            elapsed_ms = (time.perf_counter() - collector.start) * 1000.0
            self._fire(E2E, elapsed_ms, 0, err)
            _record(failure_sample(err, start_unix, self.protocol, elapsed_ms))
            if isinstance(err, TandemConnectionError):
                time.sleep(self.backoff.failed())  # a server that went away fails in microseconds: wait, retry
            elif not isinstance(err, TandemError):
                time.sleep(ERROR_BACKOFF_S)  # a client-side bug fails instantly: don't starve gevent's timers
            return
        self.backoff.succeeded()
        result = collector.result()
        for entry in entries(result):
            self._fire(entry.name, entry.response_time_ms, entry.response_length)
        _record(sample(result, start_unix, self.protocol))

    def _fire(self, name: str, ms: float, length: int, exception: Exception | None = None):
        self.environment.events.request.fire(
            request_type=self.protocol, name=name, response_time=ms, response_length=length,
            exception=exception, context={},
        )
