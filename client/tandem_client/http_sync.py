"""Blocking HTTP: Triton's /generate and /generate_stream (server-sent events) over `requests`."""
from __future__ import annotations

from typing import Iterator

import requests

from tandem_client.errors import TandemConnectionError, TandemError, connection_detail, from_http
from tandem_client.request import http_body
from tandem_client.response import chunk_from_json
from tandem_client.schema import Chunk, GenerateRequest
from tandem_client.sse import iter_events

READY_TIMEOUT_S = 5.0


class HttpStreamer:
    """A keep-alive session to Triton's HTTP port; safe for one request at a time."""

    def __init__(self, base_url: str, model: str = "llm", timeout: float | None = None, session=None):
        self.base_url, self.model, self.timeout = base_url, model, timeout
        self._session = session or requests.Session()

    def stream(self, req: GenerateRequest) -> Iterator[Chunk]:
        """Yield chunks as they arrive; closing the generator early closes the connection (Triton cancels)."""
        endpoint = "generate_stream" if req.stream else "generate"
        resp = self._post(f"{self.base_url}/v2/models/{self.model}/{endpoint}", http_body(req))
        try:
            if resp.status_code != 200:
                raise from_http(resp.status_code, resp.text)
            if not req.stream:
                chunk = chunk_from_json(resp.text)
                chunk.final = True
                yield chunk
                return
            # chunk_size=None: hand over bytes as they arrive, not after 512 have piled up
            for data in iter_events(resp.iter_lines(chunk_size=None)):
                yield chunk_from_json(data)
        except requests.RequestException as err:
            raise TandemError(f"stream from {self.base_url} broke: {err}", "UNAVAILABLE") from None
        finally:
            resp.close()  # early exit drops the connection, which is how an HTTP client cancels

    def _post(self, url: str, body: dict) -> requests.Response:
        try:
            return self._session.post(url, json=body, stream=True, timeout=self.timeout)
        except requests.ConnectionError as err:
            raise TandemConnectionError(self.base_url.split("://", 1)[-1], connection_detail(err), "http") from None
        except requests.Timeout:
            raise TandemError(f"no response within {self.timeout} s", "DEADLINE_EXCEEDED") from None

    def check_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Raise TandemConnectionError when the server cannot be reached, TandemError when the model is not ready."""
        try:
            r = self._session.get(f"{self.base_url}/v2/models/{self.model}/ready", timeout=timeout)
        except requests.ConnectionError as err:
            raise TandemConnectionError(self.base_url.split("://", 1)[-1], connection_detail(err), "http") from None
        except requests.RequestException as err:
            raise TandemError(f"readiness check at {self.base_url} failed: {err}", "UNAVAILABLE") from None
        if r.status_code != 200:
            raise TandemError(f"model '{self.model}' is not ready at {self.base_url} (HTTP {r.status_code})",
                              "UNAVAILABLE", r.status_code)

    def is_ready(self) -> bool:
        try:
            r = self._session.get(f"{self.base_url}/v2/models/{self.model}/ready", timeout=5)
            return r.status_code == 200
        except requests.RequestException:
            return False

    def close(self) -> None:
        self._session.close()
