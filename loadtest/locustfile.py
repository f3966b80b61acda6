"""Locust users that stream from a Triton LLM model and report ttft / itl / e2e as separate entries.

    locust -f loadtest/locustfile.py --host localhost:8001 --protocol grpc --max-tokens 128
Custom options (also as environment variables LOADTEST_*): --protocol, --model, --max-tokens, --temperature,
--top-p, --ignore-eos, --prompts, --samples-file, --no-stats.
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
from locust import User, constant, events, task  # importing locust monkey-patches this process with gevent

from client import Client, GenerateRequest, TandemError
from client.collect import Collector
from loadtest.metrics import E2E, entries, failure_sample, sample
from loadtest.prompts import DEFAULT_PROMPTS, load_prompts

# grpcio's own threads must yield to gevent; this has to run before any channel exists (users make them).
grpc_gevent.init_gevent()

ERROR_BACKOFF_S = 0.1
_prompts: list[str] = []
_samples_file = None


@events.init_command_line_parser.add_listener
def add_options(parser):
    parser.add_argument("--protocol", choices=["grpc", "http"], default="grpc", env_var="LOADTEST_PROTOCOL")
    parser.add_argument("--model", default="llm", env_var="LOADTEST_MODEL", help="Triton model name")
    parser.add_argument("--max-tokens", type=int, default=128, env_var="LOADTEST_MAX_TOKENS")
    parser.add_argument("--temperature", type=float, default=0.0, env_var="LOADTEST_TEMPERATURE")
    parser.add_argument("--top-p", type=float, default=1.0, env_var="LOADTEST_TOP_P")
    parser.add_argument("--ignore-eos", action="store_true", env_var="LOADTEST_IGNORE_EOS",
                        help="every request generates exactly --max-tokens tokens")
    parser.add_argument("--prompts", default=str(DEFAULT_PROMPTS), env_var="LOADTEST_PROMPTS")
    parser.add_argument("--samples-file", default="", env_var="LOADTEST_SAMPLES_FILE",
                        help="append one JSON line of exact timings per request here")
    parser.add_argument("--no-stats", action="store_true", env_var="LOADTEST_NO_STATS",
                        help="do not send the optional return_* inputs (models that lack them)")


@events.test_start.add_listener
def on_test_start(environment, **_):
    global _samples_file
    opts = environment.parsed_options
    try:  # bad settings would fail every request in a tight loop; refuse them once, up front
        _prompts[:] = load_prompts(opts.prompts)
        GenerateRequest(max_tokens=opts.max_tokens, temperature=opts.temperature, top_p=opts.top_p)
    except (OSError, ValueError) as err:
        logging.error("load test settings: %s", err)
        environment.process_exit_code = 2
        gevent.spawn(environment.runner.quit)  # quit after start() returns; quitting inside it is ignored
        return
    path = environment.parsed_options.samples_file
    if path:
        _samples_file = open(path, "a", buffering=1, encoding="utf-8")  # line-buffered: one write per sample


@events.test_stop.add_listener
def on_test_stop(environment, **_):
    if _samples_file is not None:
        _samples_file.flush()


_exit_code = [0]


@events.quitting.add_listener
def remember_exit_code(environment, **_):
    _exit_code[0] = environment.process_exit_code or 0


def _exit_now() -> None:
    """Leave before grpcio's own exit handlers: under gevent, closing a channel at interpreter exit can block
    forever (seen with py-spy), and Locust would never return. Stats and CSVs are written by then."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_exit_code[0])


atexit.register(_exit_now)  # registered after grpc's import, so it runs before grpc's handlers (LIFO)


def _record(row: dict) -> None:
    if _samples_file is not None:
        _samples_file.write(json.dumps(row) + "\n")


class LLMUser(User):
    """Sends one streaming generation at a time, back to back (closed loop: concurrency = users)."""

    wait_time = constant(0)

    def on_start(self):
        opts = self.environment.parsed_options
        self.protocol = opts.protocol
        self.client = Client(self.host, opts.protocol, opts.model)
        self.rng = random.Random()

    def on_stop(self):
        self.client.close()

    def request(self) -> GenerateRequest:
        opts = self.environment.parsed_options
        return GenerateRequest(
            prompt=self.rng.choice(_prompts), max_tokens=opts.max_tokens, temperature=opts.temperature,
            top_p=opts.top_p, ignore_eos=opts.ignore_eos, return_stats=not opts.no_stats,
        )

    @task
    def generate(self):
        start_unix = time.time()
        collector = Collector()
        try:
            req = self.request()
            for chunk in self.client.stream(req):
                collector.add(chunk)
        except Exception as err:  # noqa: BLE001 — every failure is a Locust failure, never a crashed user
            elapsed_ms = (time.perf_counter() - collector.start) * 1000.0
            self._fire(E2E, elapsed_ms, 0, err)
            _record(failure_sample(err, start_unix, self.protocol, elapsed_ms))
            if not isinstance(err, TandemError):
                time.sleep(ERROR_BACKOFF_S)  # a client-side bug fails instantly: don't starve gevent's timers
            return
        result = collector.result()
        for entry in entries(result):
            self._fire(entry.name, entry.response_time_ms, entry.response_length)
        _record(sample(result, start_unix, self.protocol))

    def _fire(self, name: str, ms: float, length: int, exception: Exception | None = None):
        self.environment.events.request.fire(
            request_type=self.protocol, name=name, response_time=ms, response_length=length,
            exception=exception, context={},
        )
