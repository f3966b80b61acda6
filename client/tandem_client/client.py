"""Client and AsyncClient: one model on one Triton server, over gRPC or HTTP, with the same API."""
from __future__ import annotations

import dataclasses
from typing import AsyncIterator, Iterator

from tandem_client.collect import Collector
from tandem_client.schema import Chunk, GenerateRequest, Result
from tandem_client.urls import resolve


def make_request(prompt: str | GenerateRequest, params: dict) -> GenerateRequest:
    """A GenerateRequest from a prompt and keyword fields, or a copy of one with fields replaced."""
    if isinstance(prompt, GenerateRequest):
        return dataclasses.replace(prompt, **params) if params else prompt
    return GenerateRequest(prompt=prompt, **params)


class Client:
    """Blocking client: `stream()` yields Chunks as they arrive, `generate()` returns the whole Result."""

    def __init__(self, url: str | None = None, protocol: str | None = None, model: str = "llm",
                 timeout: float | None = None):
        """protocol None: the URL's scheme decides (http:// → HTTP, grpc:// or host:port → gRPC)."""
        self.protocol, self.url = resolve(url, protocol)
        if self.protocol == "grpc":
            from tandem_client.grpc_sync import GrpcStreamer

            self._transport = GrpcStreamer(self.url, model, timeout)
        else:
            from tandem_client.http_sync import HttpStreamer

            self._transport = HttpStreamer(self.url, model, timeout)
        self.model = model

    def stream(self, prompt: str | GenerateRequest = "", **params) -> Iterator[Chunk]:
        """Chunks of one answer; stop iterating (or close the generator) to cancel it on the server."""
        return self._transport.stream(make_request(prompt, params))

    def generate(self, prompt: str | GenerateRequest = "", **params) -> Result:
        collector = Collector()
        for chunk in self.stream(prompt, **params):
            collector.add(chunk)
        return collector.result()

    def is_ready(self) -> bool:
        return self._transport.is_ready()

    def check_ready(self) -> None:
        """Raise TandemConnectionError when the server cannot be reached, TandemError when the model is not ready."""
        self._transport.check_ready()

    def close(self) -> None:
        self._transport.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient:
    """asyncio client with the same API as Client; concurrent streams share one connection."""

    def __init__(self, url: str | None = None, protocol: str | None = None, model: str = "llm",
                 timeout: float | None = None):
        self.protocol, self.url = resolve(url, protocol)
        if self.protocol == "grpc":
            from tandem_client.grpc_aio import AsyncGrpcStreamer

            self._transport = AsyncGrpcStreamer(self.url, model, timeout)
        else:
            from tandem_client.http_aio import AsyncHttpStreamer

            self._transport = AsyncHttpStreamer(self.url, model, timeout)
        self.model = model

    def stream(self, prompt: str | GenerateRequest = "", **params) -> AsyncIterator[Chunk]:
        """Async chunks of one answer; `break` cancels it on the server once the loop finalises the generator
        (wrap in contextlib.aclosing() to cancel at the break itself)."""
        return self._transport.stream(make_request(prompt, params))

    async def generate(self, prompt: str | GenerateRequest = "", **params) -> Result:
        collector = Collector()
        stream = self.stream(prompt, **params)
        try:
            async for chunk in stream:
                collector.add(chunk)
        finally:
            await stream.aclose()
        return collector.result()

    async def is_ready(self) -> bool:
        return await self._transport.is_ready()

    async def close(self) -> None:
        await self._transport.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
