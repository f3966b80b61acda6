"""Tandem client: stream answers from a Triton LLM model (vLLM-backend conventions) over gRPC or HTTP.

    from tandem_client import Client
    with Client("localhost:8001") as c:
        for chunk in c.stream("The capital of France is", max_tokens=16):
            print(chunk.text, end="", flush=True)
"""
from tandem_client.client import AsyncClient, Client, make_request
from tandem_client.errors import TandemConnectionError, TandemError
from tandem_client.schema import Chunk, GenerateRequest, Result
from tandem_client.urls import DEFAULT_URLS

__all__ = [
    "AsyncClient",
    "Chunk",
    "Client",
    "DEFAULT_URLS",
    "GenerateRequest",
    "Result",
    "TandemConnectionError",
    "TandemError",
    "make_request",
]
