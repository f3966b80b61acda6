"""asyncio gRPC streaming over tritonclient.grpc.aio."""
from __future__ import annotations

import uuid
from typing import AsyncIterator

import grpc
import tritonclient.grpc.aio as aioclient

from tandem_client.errors import from_grpc, from_rpc_error
from tandem_client.request import grpc_inputs
from tandem_client.response import chunk_from_grpc
from tandem_client.schema import Chunk, GenerateRequest


class AsyncGrpcStreamer:
    """One aio channel to Triton; each `stream()` call opens its own gRPC stream, so calls may overlap."""

    def __init__(self, url: str, model: str = "llm", timeout: float | None = None):
        self.url, self.model, self.timeout = url, model, timeout
        self._client = aioclient.InferenceServerClient(url)

    async def stream(self, req: GenerateRequest) -> AsyncIterator[Chunk]:
        """Yield chunks as they arrive; leaving the loop early cancels the request on the server."""

        async def one_request():
            # One request, then the request side half-closes: Triton ends the RPC after the last response,
            # so the end of iteration is the end of the answer (the aio API cannot ask for the final flag).
            yield {"model_name": self.model, "inputs": grpc_inputs(req), "request_id": uuid.uuid4().hex}

        call = self._client.stream_infer(one_request(), stream_timeout=self.timeout)
        done = False
        try:
            async for result, error in call:
                if error is not None:
                    done = True
                    raise from_grpc(error, self.url)
                chunk = chunk_from_grpc(result)
                chunk.final = chunk.final or chunk.finish_reason is not None
                yield chunk
            done = True
        except grpc.aio.AioRpcError as err:
            done = True
            raise from_rpc_error(err, self.url) from None
        finally:
            if not done:
                call.cancel()  # caller stopped early (break, aclose, task cancelled): stop the server's work

    async def is_ready(self) -> bool:
        try:
            return await self._client.is_server_live() and await self._client.is_model_ready(self.model)
        except Exception:  # any transport failure means "not ready" here
            return False

    async def close(self) -> None:
        await self._client.close()


