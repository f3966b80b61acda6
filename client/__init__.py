"""Tandem client: stream answers from a Triton LLM model (vLLM-backend conventions) over gRPC or HTTP.

    from client import Client
    with Client("localhost:8001") as c:
        for chunk in c.stream("The capital of France is", max_tokens=16):
            print(chunk.text, end="", flush=True)
"""
from client.client import AsyncClient, Client, make_request
from client.errors import TandemConnectionError, TandemError
from client.schema import Chunk, GenerateRequest, Result
from client.urls import DEFAULT_URLS

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
