"""Blocking gRPC streaming over tritonclient.grpc (bidirectional ModelStreamInfer)."""
from __future__ import annotations

import queue
import uuid
from typing import Iterator

import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tandem_client.errors import TandemError, from_grpc
from tandem_client.request import grpc_inputs
from tandem_client.response import chunk_from_grpc, is_empty_grpc
from tandem_client.schema import Chunk, GenerateRequest

READY_TIMEOUT_S = 5.0


class GrpcStreamer:
    """One channel to Triton; one stream at a time (use one per thread or greenlet)."""

    def __init__(self, url: str, model: str = "llm", timeout: float | None = None):
        self.url, self.model, self.timeout = url, model, timeout
        self._client = grpcclient.InferenceServerClient(url)

    def stream(self, req: GenerateRequest) -> Iterator[Chunk]:
        """Yield chunks as they arrive; closing the generator early cancels the request on the server."""
        responses: queue.Queue = queue.Queue()
        # a previous stream whose generator was dropped unclosed still holds the client's one stream: end it
        self._client.stop_stream(cancel_requests=True)
        self._client.start_stream(callback=lambda result, error: responses.put((result, error)))
        done = False
        try:
            self._send(req, responses)
            while not done:
                result, error = self._next(responses)
                if error is not None:
                    done = True  # the server ended this request with the error; nothing left to cancel
                    raise from_grpc(error, self.url)
                chunk = chunk_from_grpc(result)
                done = chunk.final
                if not (done and is_empty_grpc(result)):
                    yield chunk
        finally:
            # Early exit (caller stopped reading, Ctrl-C, GreenletExit): cancel so the server frees the slot.
            self._client.stop_stream(cancel_requests=not done)

    def _send(self, req: GenerateRequest, responses: queue.Queue) -> None:
        try:
            self._client.async_stream_infer(
                self.model, grpc_inputs(req), request_id=uuid.uuid4().hex, enable_empty_final_response=True
            )
        except InferenceServerException as err:
            # The stream died before the request went out (server down); its callback holds the real cause.
            try:
                _, err = responses.get(timeout=1.0)
            except queue.Empty:
                pass
            raise from_grpc(err, self.url) from None

    def _next(self, responses: queue.Queue):
        try:
            return responses.get(timeout=self.timeout)
        except queue.Empty:
            raise TandemError(f"no response within {self.timeout} s", "DEADLINE_EXCEEDED") from None

    def check_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Raise TandemConnectionError when the server cannot be reached, TandemError when the model is not ready."""
        try:
            ready = (self._client.is_server_live(client_timeout=timeout)
                     and self._client.is_model_ready(self.model, client_timeout=timeout))
        except InferenceServerException as err:
            raise from_grpc(err, self.url) from None
        if not ready:
            raise TandemError(f"model '{self.model}' is not ready at {self.url} (gRPC)", "UNAVAILABLE")

    def is_ready(self) -> bool:
        """Server live and this model ready; False (not an exception) when the server is down."""
        try:
            return self._client.is_server_live() and self._client.is_model_ready(self.model)
        except Exception:  # tritonclient raises its own exception for every transport failure
            return False

    def close(self) -> None:
        self._client.close()
