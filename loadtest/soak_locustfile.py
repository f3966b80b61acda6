"""Soak users: normal streams, clients that stop reading mid-stream, and bad inputs the server must refuse.

    locust -f loadtest/soak_locustfile.py --host localhost:8001 --http-host http://localhost:8000
        --events-file events.jsonl --samples-file samples.jsonl   (one command; `python -m loadtest.soak` runs it)
Normal streams report ttft/itl/e2e as loadtest/locustfile.py does (their samples feed loadtest.report). Cancels
and refused bad inputs are expected outcomes: Locust successes named "cancel" and "bad_input", one line each in
--events-file. Anything else (an error on a normal stream or a cancel, a bad input accepted or refused with the
wrong error) is a Locust failure and a failure line in --samples-file.
"""
from __future__ import annotations

import gc
import json
import random
import signal
import sys
import time
import traceback
from dataclasses import dataclass

import gevent
import greenlet
from locust import User, between, constant, events, task

from tandem_client import Client, GenerateRequest, TandemConnectionError, TandemError
from loadtest import locustfile as base  # a module, not its classes: Locust would run every User in this namespace
from loadtest.backoff import Backoff
from loadtest.metrics import failure_sample

CANCEL, BAD_INPUT = "cancel", "bad_input"
TIMED_CANCEL_SHARE = 0.2  # cancels at a random time (maybe before the first token) rather than after n tokens
_events_file = None
_clients: list[Client] = []  # closed at test stop, see close_clients


@events.init_command_line_parser.add_listener
def add_soak_options(parser):
    parser.add_argument("--http-host", default="", env_var="LOADTEST_HTTP_HOST",
                        help="also use HTTP (e.g. http://localhost:8000): each user picks gRPC or HTTP")
    parser.add_argument("--events-file", default="", env_var="LOADTEST_EVENTS_FILE",
                        help="append one JSON line per expected cancel or refused bad input")


@events.test_start.add_listener
def open_events_file(environment, **_):
    global _events_file
    path = environment.parsed_options.events_file
    if path:
        _events_file = open(path, "a", buffering=1, encoding="utf-8")  # line-buffered: one write per event


@events.test_stop.add_listener
def close_clients(environment, **_):
    """Close every user's client while gevent still runs: a tritonclient gRPC channel left to __del__ at
    interpreter exit blocks forever in Channel.close() under gevent (seen with py-spy), so Locust never exits."""
    while _clients:
        try:
            _clients.pop().close()
        except Exception:  # noqa: BLE001 — closing is best effort; a broken client must not keep the rest open
            pass


def dump_greenlets() -> None:
    """SIGUSR1: every greenlet's stack to stderr, to see what a Locust that will not stop is blocked in."""
    for g in gc.get_objects():
        if isinstance(g, greenlet.greenlet) and g.gr_frame is not None:
            print(f"---- {g!r}", file=sys.stderr)
            traceback.print_stack(g.gr_frame, file=sys.stderr)
    sys.stderr.flush()


gevent.signal_handler(signal.SIGUSR1, dump_greenlets)


def record_event(row: dict) -> None:
    if _events_file is not None:
        _events_file.write(json.dumps(row) + "\n")


def pick_transport(user: User) -> tuple[str, str]:
    """gRPC, or HTTP for about half the users when --http-host is set: both frontends cancel differently."""
    opts = user.environment.parsed_options
    protocol, address = base.target()  # stops the user when the run's start was refused
    if opts.http_host and user.rng.random() < 0.5:
        return "http", opts.http_host
    return protocol, address


class SoakMixin:
    """What every soak user shares: gRPC or HTTP, prompts as base.LLMUser makes them, unexpected outcomes as failures.

    A mixin, not a base User: Locust gives a User class every @task of its bases too, so CancelUser and
    BadInputUser must not inherit base.LLMUser's normal-stream task.
    """

    wait_time = constant(0)
    on_stop = base.LLMUser.on_stop
    request = base.LLMUser.request  # in the chat template unless --raw-prompts (see loadtest/locustfile.py)
    _fire = base.LLMUser._fire

    def on_start(self):
        opts = self.environment.parsed_options
        self.rng = random.Random()
        self.protocol, host = pick_transport(self)
        self.client = Client(host, self.protocol, opts.model)
        self.backoff = Backoff()
        _clients.append(self.client)

    def fail(self, name: str, err: Exception, started: float, start_unix: float) -> None:
        """An unexpected outcome: a Locust failure and a failure line in the samples file."""
        elapsed_ms = (time.perf_counter() - started) * 1000.0
        self._fire(name, elapsed_ms, 0, err)
        base._record(failure_sample(err, start_unix, self.protocol, elapsed_ms) | {"kind": name})
        if isinstance(err, TandemConnectionError):
            time.sleep(self.backoff.failed())  # a server that went away fails in microseconds: wait, retry
        elif not isinstance(err, TandemError):
            time.sleep(base.ERROR_BACKOFF_S)  # a client-side bug fails instantly: don't starve gevent's timers


class SoakUser(SoakMixin, base.LLMUser):
    """A normal streaming user: base.LLMUser's task, on gRPC or HTTP."""

    weight = 3


class CancelUser(SoakMixin, User):
    """Stops reading mid-stream (after n tokens, or after a random time): the client cancels the request."""

    weight = 2

    @task
    def generate(self):
        opts = self.environment.parsed_options
        req = self.request()
        req.ignore_eos = True  # the request must still be running when the client walks away
        timed = self.rng.random() < TIMED_CANCEL_SHARE
        limit = self.rng.uniform(0.0, 1.0) if timed else self.rng.randint(1, max(1, opts.max_tokens // 2))
        started, start_unix, tokens = time.perf_counter(), time.time(), 0
        stream = self.client.stream(req)
        try:
            tokens = self._read_until(stream, timed, limit)
        except Exception as err:  # noqa: BLE001 — a cancel must not fail; anything raised is unexpected
            self.fail(CANCEL, err, started, start_unix)
            return
        finally:
            stream.close()  # cancels on the server (gRPC stop_stream(cancel_requests=True); HTTP closes)
        ms = (time.perf_counter() - started) * 1000.0
        self._fire(CANCEL, ms, tokens)
        self.backoff.succeeded()
        record_event({"kind": CANCEL, "start": start_unix, "protocol": self.protocol, "ms": ms, "tokens": tokens,
                      "timed": timed})

    @staticmethod
    def _read_until(stream, timed: bool, limit: float) -> int:
        tokens = 0
        if timed:
            with gevent.Timeout(limit, False):  # raised inside the generator's wait; False: swallowed here
                for chunk in stream:
                    tokens += chunk.tokens()
            return tokens
        for chunk in stream:
            tokens += chunk.tokens()
            if tokens >= limit:
                break
        return tokens


@dataclass(slots=True)
class BadInput:
    """A request the server must refuse with INVALID_ARG, and a word its error message must contain."""

    name: str
    request: GenerateRequest
    expect: str


def bad_inputs() -> list[BadInput]:
    prompt = "Hello"
    return [
        BadInput("negative temperature", GenerateRequest(prompt, extra={"temperature": -1}), "temperature"),
        BadInput("zero max_tokens", GenerateRequest(prompt, extra={"max_tokens": 0}), "max_tokens"),
        BadInput("unknown sampling key", GenerateRequest(prompt, max_tokens=4, extra={"max_tokenz": 4}), "max_tokenz"),
        BadInput("top_p out of range", GenerateRequest(prompt, max_tokens=4, extra={"top_p": 2.0}), "top_p"),
        BadInput("longer than the model", GenerateRequest(prompt, max_tokens=10**7), "max_tokens"),
        BadInput("empty prompt", GenerateRequest("", max_tokens=4), "text_input"),
        BadInput("token id outside the vocabulary", GenerateRequest(input_ids=[10**9], max_tokens=4), "token id"),
        BadInput("stream with the prompt echoed", GenerateRequest(prompt, max_tokens=4, exclude_input=False),
                 "exclude_input_in_output"),
    ]


BAD_INPUTS = bad_inputs()


class BadInputUser(SoakMixin, User):
    """Sends requests the server must refuse with INVALID_ARG (HTTP 400); a refusal is the expected outcome."""

    weight = 1
    wait_time = between(0.2, 1.0)  # refusals are instant: don't let one user flood the server with them

    @task
    def generate(self):
        case = self.rng.choice(BAD_INPUTS)
        started, start_unix = time.perf_counter(), time.time()
        try:
            result = self.client.generate(case.request)
        except TandemError as err:
            if self._expected(err, case):
                ms = (time.perf_counter() - started) * 1000.0
                self._fire(BAD_INPUT, ms, 0)
                self.backoff.succeeded()
                record_event({"kind": BAD_INPUT, "start": start_unix, "protocol": self.protocol, "case": case.name})
                return
            self.fail(BAD_INPUT, TandemError(f"{case.name}: wrong refusal: {err}", err.status), started, start_unix)
        except Exception as err:  # noqa: BLE001
            self.fail(BAD_INPUT, err, started, start_unix)
        else:
            err = TandemError(f"{case.name}: accepted ({result.num_output_tokens} tokens), expected INVALID_ARG")
            self.fail(BAD_INPUT, err, started, start_unix)

    def _expected(self, err: TandemError, case: BadInput) -> bool:
        # gRPC stream errors carry the model's message but no status code; HTTP maps INVALID_ARG to 400.
        status_ok = err.status == "INVALID_ARG" if self.protocol == "http" else err.status in (None, "INVALID_ARG")
        return status_ok and case.expect in err.message
