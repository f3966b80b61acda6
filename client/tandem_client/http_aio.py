"""asyncio HTTP: Triton's /generate and /generate_stream (server-sent events) over aiohttp."""
from __future__ import annotations

from typing import AsyncIterator

import aiohttp

from tandem_client.errors import TandemConnectionError, TandemError, connection_detail, from_http
from tandem_client.request import http_body
from tandem_client.response import chunk_from_json
from tandem_client.schema import Chunk, GenerateRequest
from tandem_client.sse import SSEDecoder


class AsyncHttpStreamer:
    """An aiohttp session to Triton's HTTP port; concurrent `stream()` calls are fine."""

    def __init__(self, base_url: str, model: str = "llm", timeout: float | None = None):
        self.base_url, self.model = base_url, model
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._session: aiohttp.ClientSession | None = None  # made lazily: it must be born inside a loop

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        return self._session

    async def stream(self, req: GenerateRequest) -> AsyncIterator[Chunk]:
        """Yield chunks as they arrive; leaving early releases the connection, which cancels on Triton."""
        endpoint = "generate_stream" if req.stream else "generate"
        url = f"{self.base_url}/v2/models/{self.model}/{endpoint}"
        try:
            async with self._get_session().post(url, json=http_body(req)) as resp:
                if resp.status != 200:
                    raise from_http(resp.status, await resp.text())
                if not req.stream:
                    chunk = chunk_from_json(await resp.text())
                    chunk.final = True
                    yield chunk
                    return
                decoder = SSEDecoder()
                async for line in resp.content:  # one line at a time, as the server flushes them
                    data = decoder.feed(line)
                    if data is not None:
                        yield chunk_from_json(data)
                if (data := decoder.flush()) is not None:
                    yield chunk_from_json(data)
        except aiohttp.ClientConnectorError as err:
            raise TandemConnectionError(self.base_url.split("://", 1)[-1], connection_detail(err), "http") from None
        except aiohttp.ClientError as err:
            raise TandemError(f"stream from {self.base_url} broke: {err}", "UNAVAILABLE") from None

    async def is_ready(self) -> bool:
        try:
            async with self._get_session().get(f"{self.base_url}/v2/models/{self.model}/ready") as r:
                return r.status == 200
        except aiohttp.ClientError:
            return False

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
