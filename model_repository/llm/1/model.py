"""Triton entry point: a thin adapter between Triton's decoupled requests and the Tandem engine."""
from __future__ import annotations

import gc
import itertools
import json
import os
import sys
import threading
import time


def _apply_pythonpath() -> None:
    """The stub's interpreter runs isolated (ignores PYTHONPATH): apply it, so the venv and repo import."""
    here = os.path.dirname(os.path.abspath(__file__))  # first, so protocol/metrics/sender are ours
    for path in reversed([here] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]):
        if path in sys.path:
            sys.path.remove(path)
        sys.path.insert(0, path)


_apply_pythonpath()

import numpy as np  # noqa: E402
import triton_python_backend_utils as pb_utils  # noqa: E402
from numpy_compat import hide_packages_needing_numpy2  # noqa: E402

HIDDEN_FOR_NUMPY1 = hide_packages_needing_numpy2()  # before transformers is imported: see numpy_compat

from backend import Engine, EngineConfig, EngineDead, EngineOverloaded  # noqa: E402
from adapter_flags import adapter_flags  # noqa: E402
from metrics import ServingMetrics  # noqa: E402
from protocol import parse_request  # noqa: E402
from drain import Drain, held_marker  # noqa: E402
from lifecycle import DRAIN_FILE_ENV, LifeWatch  # noqa: E402
from sender import FINAL, ActiveRequest, ResponseLoop, error_response  # noqa: E402

DEFAULT_DRAIN_TIMEOUT_S = 25.0  # below Triton's default --exit-timeout-secs (30), so every stream ends before it

# config.pbtxt parameters that are not engine settings
ADAPTER_SETTINGS = ("stats_interval_s", "log_prompts", "unload_on_engine_failure", "drain_timeout_s",
                    # the vLLM backend's names, for configs written for it: its vllm:* metric series, and its health
                    # check (an engine that stopped answers UNAVAILABLE and the model unloads: unload_on_engine_failure)
                    "REPORT_CUSTOM_METRICS", "ENABLE_VLLM_HEALTH_CHECK")


def stub_numpy_problem() -> str | None:
    """Why this stub would corrupt every tensor with the numpy it imported, or None.

    The python-backend stubs of nvidia-pytriton 0.7.0 (Triton 24.10) use a pybind11 older than 2.12, which reads
    a dtype's item size where NumPy 1.x kept it; under NumPy 2 it reads 0. Then each numeric input arrives as
    its first element repeated, each BYTES input as its first byte repeated (the stub then dies in
    deserialize_bytes_tensor, "unpack_from requires a buffer of at least 960051517 bytes ...", before execute()
    runs), and each output tensor leaves empty. No code here can undo that, so the model refuses to load.
    Such a stub names only "numpy.core.multiarray"; pybind11 >= 2.12 also names "numpy._core".
    (scripts/tritonserver_env.py makes the same check before starting a server.)
    """
    if int(np.__version__.split(".")[0]) < 2:
        return None
    try:
        with open("/proc/self/exe", "rb") as f:  # this process is the stub
            exe = f.read()
    except OSError:
        return None
    if b"numpy._core" in exe or b"numpy.core.multiarray" not in exe:
        return None  # a NumPy-2-aware stub, or one we cannot tell
    return (f"numpy {np.__version__} ({os.path.dirname(np.__file__)}) is loaded in a Python-backend stub built "
            "for NumPy 1.x (its pybind11 predates NumPy 2): every tensor would be corrupted and the first BYTES "
            "input would kill the stub. Install numpy<2 where the stub imports it (requirements-serve.txt pins "
            "numpy==1.26.4), or put a folder with numpy<2 first on the server's PYTHONPATH")


class TritonPythonModel:
    """One engine per model instance; execute() only hands requests over, the sender thread answers."""

    def initialize(self, args: dict) -> None:
        problem = stub_numpy_problem()  # before the engine: fail the load now, not the first request
        if problem:
            raise RuntimeError(f"tandem: {problem}")
        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise ValueError("config.pbtxt: the Tandem model needs model_transaction_policy { decoupled: true }")
        settings = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        adapter = {k: settings.pop(k) for k in ADAPTER_SETTINGS if k in settings}
        if args.get("model_instance_kind") == "GPU" and settings.get("device", "auto") == "auto":
            settings["device"] = f"cuda:{args['model_instance_device_id']}"  # KIND_GPU: one engine per GPU
        flags = adapter_flags(adapter)  # before the engine starts: a typo fails the load with nothing to stop
        try:
            self.engine = Engine(EngineConfig.from_dict(settings).validate())
        except ValueError as err:
            raise ValueError(f"config.pbtxt parameters: {err}") from None
        self._log_prompts = flags["log_prompts"]
        self._closing = False
        self._ids = itertools.count()
        instance = _instance_label(args)
        vllm_series = self.engine.max_model_len if flags["REPORT_CUSTOM_METRICS"] else None
        metrics = ServingMetrics(args["model_name"], args["model_version"], instance, vllm_max_model_len=vllm_series)
        self._model_name = args["model_name"]
        self._unload_on_failure = flags["unload_on_engine_failure"] and _instances(config) == 1
        self.loop = ResponseLoop(self.engine, metrics, float(adapter.get("stats_interval_s", "0.5")),
                                 on_engine_dead=self._engine_dead)
        self.loop.start()
        self._drain_timeout_s = _seconds(adapter.get("drain_timeout_s"), DEFAULT_DRAIN_TIMEOUT_S, "drain_timeout_s")
        self._draining = False
        self._drainer: Drain | None = None
        self._stop_lock = threading.Lock()  # the engine stops once: in finalize, or after a drain Triton holds
        self._stopped = False
        self._watch = LifeWatch(on_orphaned=self._orphaned, on_drain=self._drain)
        self._watch.start()
        if HIDDEN_FOR_NUMPY1:
            pb_utils.Logger.log_info(f"tandem: numpy {np.__version__}: hid packages that need NumPy 2: "
                                     f"{', '.join(HIDDEN_FOR_NUMPY1)}")
        pb_utils.Logger.log_info(f"tandem: engine ready ({args['model_name']}, instance {instance}, "
                                 f"device {self.engine.device})")

    def execute(self, requests: list) -> None:
        # No lock against the sender thread: responses from another thread while execute() runs is the python
        # backend's decoupled pattern. The "BYTES corruption under load" once blamed on that overlap was NumPy 2
        # in a NumPy-1 stub (see stub_numpy_problem), and a lock did not change it.
        for request in requests:
            self._accept_safely(request)
        return None  # decoupled: every answer goes through the request's response sender

    def _accept_safely(self, request) -> None:
        """Accept one request; whatever goes wrong, it gets exactly one final response."""
        answer = _Answer()
        try:
            self._accept(request, answer)
        except Exception as err:  # never fail the batch; and never leave the request unanswered
            pb_utils.Logger.log_error(f"tandem: accepting a request failed: {err!r}")
            if answer.sender is not None and not answer.done:
                try:
                    self._refuse(answer.sender, f"internal error: {err!r}", pb_utils.TritonError.INTERNAL)
                except Exception as send_err:  # e.g. the client left before its error reply
                    pb_utils.Logger.log_warn(f"tandem: could not answer a request: {send_err!r}")

    def _accept(self, request, answer: "_Answer") -> None:
        answer.sender = sender = request.get_response_sender()
        if self._closing or self._draining or not self.engine.healthy:
            # a drain's stop (its engine stopped while Triton holds the model) still says the server is going
            msg = ("the server is shutting down; retry on another replica" if self._draining
                   else "the model is unloading" if self._closing else "the engine is not healthy; see the server log")
            answer.done = True
            self._refuse(sender, msg, pb_utils.TritonError.UNAVAILABLE)
            return
        try:
            req = parse_request(lambda name: _input(request, name), request.parameters())
        except ValueError as err:
            answer.done = True
            self._refuse(sender, str(err), pb_utils.TritonError.INVALID_ARG)
            return
        request_id = f"{request.request_id() or 'req'}-{next(self._ids)}"
        if self._log_prompts:
            pb_utils.Logger.log_info(f"tandem: request {request_id} prompt={req.prompt!r}")
        active = ActiveRequest(request_id, sender, req, self._prefix(req), time.monotonic())
        self.loop.register(active)
        answer.done = True  # from here on the sender thread owns the request's final response
        try:
            self.engine.add_request(req.prompt, req.params, request_id=request_id, sink=self.loop.queue,
                                    stream=req.stream)
        except Exception as err:
            if isinstance(err, ValueError):
                code, msg = pb_utils.TritonError.INVALID_ARG, str(err)
            elif isinstance(err, EngineOverloaded):
                code, msg = pb_utils.TritonError.UNAVAILABLE, f"server overloaded, retry after a short backoff: {err}"
            elif isinstance(err, EngineDead):
                code, msg = pb_utils.TritonError.UNAVAILABLE, f"the engine is not running: {err}"
            else:
                code, msg = pb_utils.TritonError.INTERNAL, f"could not start the request: {err!r}"
            # the sender thread answers it: only that thread sends on a registered stream or asks is_cancelled(),
            # so no sender is queried after its final response freed it (seen as a segfault in a soak)
            self.loop.fail(request_id, msg, code)

    def _refuse(self, sender, message: str, code) -> None:
        """A request's final error response from this (the execute) thread, counted once it is sent."""
        sender.send(error_response(message, code), flags=FINAL)
        loop = self.loop  # None once finalize has freed the loop and its metrics
        if loop is not None:
            loop.error_sent(code)

    def _prefix(self, req) -> str:
        """The prompt text a non-streaming response starts with (vLLM's exclude_input_in_output=false)."""
        if not req.prepend_input:
            return ""
        if isinstance(req.prompt, str):
            return req.prompt
        try:
            return self.engine.tokenizer.decode(req.prompt)
        except Exception:
            return ""  # ids the tokenizer cannot decode: the engine rejects them anyway

    def _engine_dead(self) -> None:
        """The engine stopped after repeated step faults (sender thread): stop looking ready.

        The python backend (Triton 24.10) has no per-instance readiness hook, so /v2/models/<name>/ready stays
        200 while the stub lives. With explicit model control the model unloads itself, which turns readiness
        off (a load request brings a fresh engine); otherwise, or with several instances, it stays loaded and
        answers every request UNAVAILABLE ("the engine is not healthy"). tandem_engine_healthy reads 0 either way.
        """
        pb_utils.Logger.log_error("tandem: the engine stopped after repeated faults; new requests get UNAVAILABLE")
        if not self._unload_on_failure:
            return
        try:
            pb_utils.unload_model(self._model_name)  # asynchronous in Triton: returns before finalize() runs
            pb_utils.Logger.log_error(f"tandem: unloading model {self._model_name!r} so it reports not ready")
        except Exception as err:  # e.g. model control mode none/poll: stays loaded, answers UNAVAILABLE
            pb_utils.Logger.log_warn(f"tandem: could not unload {self._model_name!r} ({err}); it stays loaded and "
                                     "answers UNAVAILABLE until reloaded or restarted")

    def _drain(self) -> None:
        """The launcher is stopping the server (lifecycle.py): take no new requests; the drain is over once none is
        in flight, and streams still running after drain_timeout_s get their final response then, before Triton's
        exit timeout would cut them (drain.py, also for a model Triton keeps loaded after the drain)."""
        self._draining = True
        pb_utils.Logger.log_info(f"tandem: shutting down: draining, at most {self._drain_timeout_s:g} s")
        drain_file = os.environ.get(DRAIN_FILE_ENV)
        self._drainer = Drain(self._in_flight, self._abort_all, self._stop_engine, self._drain_timeout_s,
                              held_marker(drain_file, os.getpid()) if drain_file else None,
                              pb_utils.Logger.log_info)
        self._drainer.start()

    # The drain reaches the sender loop through these, never holding it: finalize must free the loop (and its
    # metric objects, whose destruction in the stub's own teardown segfaults it)
    def _in_flight(self) -> int:
        loop = self.loop
        return loop.in_flight() if loop is not None else 0

    def _abort_all(self, message: str) -> int:
        loop = self.loop
        return loop.abort_all(message) if loop is not None else 0

    def _orphaned(self) -> None:
        """tritonserver is gone (lifecycle.py): nobody can receive an answer. Exit at once: the process's end frees
        its device memory (an orderly engine shutdown could wait on threads that wait on the dead server)."""
        try:
            print("tandem: tritonserver is gone; the model's stub exits", file=sys.stderr, flush=True)
        finally:
            os._exit(1)

    def finalize(self) -> None:
        self._watch.stop()
        if self._drainer is not None:
            self._drainer.finalizing()
        self._stop_engine()

    def _stop_engine(self) -> bool:
        """Stop the engine and the sender thread in order, once (finalize, or a drain whose model Triton keeps
        loaded: drain.py); False when that was done before."""
        with self._stop_lock:
            if self._stopped:
                return False
            self._stopped = True
            self._closing = self.loop.closing = True
            gc_figures = {k: v for k, v in self.engine.stats().items() if k.startswith("gc_")}
            pb_utils.Logger.log_info(f"tandem: garbage collector since start: {gc_figures}")
            self.engine.shutdown()  # every unfinished request gets a final "abort" output in the queue
            self.loop.stop()
            pb_utils.Logger.log_info("tandem: engine stopped")
            # why: metric objects destroyed during the stub's own teardown crash it (segfault at exit); free them
            # while the stub is still whole
            self.loop = self.engine = None
            gc.collect()
            return True


class _Answer:
    """Whether an incoming request's one final response has been sent, or handed to the sender thread."""

    __slots__ = ("sender", "done")

    def __init__(self) -> None:
        self.sender = None
        self.done = False


def _seconds(text: str | None, default: float, name: str) -> float:
    if text is None or not text.strip():
        return default
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"config.pbtxt parameters: {name} must be a number of seconds, got {text!r}") from None
    if not value >= 0:
        raise ValueError(f"config.pbtxt parameters: {name} must be >= 0, got {text!r}")
    return value


def _instance_label(args: dict) -> str:
    """The instance's name, unique per server: Triton gives a KIND_GPU group's instances the same name on every
    GPU (llm_0_0 on GPU 0 and on GPU 1), and instances sharing metric labels share each Metric object."""
    name = args["model_instance_name"]
    return f"{name}@gpu{args['model_instance_device_id']}" if args.get("model_instance_kind") == "GPU" else name


def _instances(config: dict) -> int:
    """Model instances this config starts (KIND_GPU: count per listed GPU)."""
    groups = config.get("instance_group") or [{"count": 1}]
    return sum(int(g.get("count", 1)) * max(1, len(g.get("gpus") or [])) for g in groups)


def _input(request, name: str):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()
