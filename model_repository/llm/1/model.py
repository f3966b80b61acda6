"""Triton entry point: a thin adapter between Triton's decoupled requests and the Tandem engine."""
from __future__ import annotations

import itertools
import json
import os
import sys
import time


def _apply_pythonpath() -> None:
    """The stub's interpreter runs isolated (ignores PYTHONPATH): apply it, so the venv and repo import."""
    here = os.path.dirname(os.path.abspath(__file__))  # first, so protocol/metrics/sender are ours
    for path in reversed([here] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]):
        if path in sys.path:
            sys.path.remove(path)
        sys.path.insert(0, path)


_apply_pythonpath()

import triton_python_backend_utils as pb_utils  # noqa: E402

from backend import Engine, EngineConfig, EngineDead, EngineOverloaded  # noqa: E402
from metrics import ServingMetrics  # noqa: E402
from protocol import parse_request  # noqa: E402
from sender import FINAL, PB_LOCK, ResponseLoop, Stream, error_response  # noqa: E402

ADAPTER_SETTINGS = ("stats_interval_s", "log_prompts")  # config.pbtxt parameters that are not engine settings


class TritonPythonModel:
    """One engine per model instance; execute() only hands requests over, the sender thread answers."""

    def initialize(self, args: dict) -> None:
        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise ValueError("config.pbtxt: the Tandem model needs model_transaction_policy { decoupled: true }")
        settings = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        adapter = {k: settings.pop(k) for k in ADAPTER_SETTINGS if k in settings}
        if args.get("model_instance_kind") == "GPU" and settings.get("device", "auto") == "auto":
            settings["device"] = f"cuda:{args['model_instance_device_id']}"  # KIND_GPU: one engine per GPU
        try:
            self.engine = Engine(EngineConfig.from_dict(settings).validate())
        except ValueError as err:
            raise ValueError(f"config.pbtxt parameters: {err}") from None
        self._log_prompts = adapter.get("log_prompts", "false").strip().lower() in ("1", "true", "yes")
        self._closing = False
        self._ids = itertools.count()
        metrics = ServingMetrics(args["model_name"], args["model_version"])
        self.loop = ResponseLoop(self.engine, metrics, float(adapter.get("stats_interval_s", "0.5")))
        self.loop.start()
        pb_utils.Logger.log_info(f"tandem: engine ready ({args['model_name']}, instance {args['model_instance_name']})")

    def execute(self, requests: list) -> None:
        with PB_LOCK:  # why: one thread at a time in the stub (see sender.PB_LOCK)
            for request in requests:
                self._accept_safely(request)
        return None  # decoupled: every answer goes through the request's response sender

    def _accept_safely(self, request) -> None:
        try:
            self._accept(request)
        except Exception as err:  # e.g. the client left before its error reply: never fail the batch
            pb_utils.Logger.log_warn(f"tandem: could not answer a request: {err!r}")

    def _accept(self, request) -> None:
        sender = request.get_response_sender()
        if self._closing or not self.engine.healthy:
            msg = "the model is unloading" if self._closing else "the engine is not healthy; see the server log"
            sender.send(error_response(msg, pb_utils.TritonError.UNAVAILABLE), flags=FINAL)
            return
        try:
            req = parse_request(lambda name: _input(request, name), request.parameters())
        except ValueError as err:
            sender.send(error_response(str(err), pb_utils.TritonError.INVALID_ARG), flags=FINAL)
            return
        request_id = f"{request.request_id() or 'req'}-{next(self._ids)}"
        if self._log_prompts:
            pb_utils.Logger.log_info(f"tandem: request {request_id} prompt={req.prompt!r}")
        self.loop.register(Stream(request_id, sender, req, self._prefix(req), time.monotonic()))
        try:
            self.engine.add_request(req.prompt, req.params, request_id=request_id, sink=self.loop.queue)
        except Exception as err:
            if isinstance(err, ValueError):
                code, msg = pb_utils.TritonError.INVALID_ARG, str(err)
            elif isinstance(err, EngineOverloaded):
                code, msg = pb_utils.TritonError.UNAVAILABLE, f"server overloaded, retry after a short backoff: {err}"
            elif isinstance(err, EngineDead):
                code, msg = pb_utils.TritonError.UNAVAILABLE, f"the engine is not running: {err}"
            else:
                code, msg = pb_utils.TritonError.INTERNAL, f"could not start the request: {err!r}"
            if self.loop.claim(request_id) is not None:
                sender.send(error_response(msg, code), flags=FINAL)

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

    def finalize(self) -> None:
        self._closing = self.loop.closing = True
        self.engine.shutdown()  # every unfinished request gets a final "abort" output in the queue
        self.loop.stop()
        pb_utils.Logger.log_info("tandem: engine stopped")


def _input(request, name: str):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()
