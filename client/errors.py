"""Exceptions the client raises, and the mapping from transport errors to them."""
from __future__ import annotations

# HTTP status → Triton's status name, as Triton's HTTP frontend maps them (http_server.cc).
_HTTP_TO_TRITON = {
    400: "INVALID_ARG",
    404: "NOT_FOUND",
    409: "ALREADY_EXISTS",
    499: "CANCELLED",
    500: "INTERNAL",
    501: "UNSUPPORTED",
    503: "UNAVAILABLE",
}


class TandemError(Exception):
    """The server refused or failed a request; carries Triton's status and message."""

    def __init__(self, message: str, status: str | None = None, http_status: int | None = None):
        super().__init__(message)
        self.message = message
        self.status = status  # Triton/gRPC status name, e.g. "INVALID_ARG"; None when the transport drops it
        self.http_status = http_status

    def __str__(self) -> str:
        return f"{self.status}: {self.message}" if self.status else self.message


class TandemConnectionError(TandemError):
    """The server could not be reached at all (not started, wrong port, network down)."""

    def __init__(self, url: str, detail: str = ""):
        super().__init__(f"cannot reach Triton at {url}" + (f" ({detail})" if detail else ""), "UNAVAILABLE")
        self.url = url


def from_grpc(error, url: str) -> TandemError:
    """Map a tritonclient InferenceServerException (sync or aio) to a TandemError."""
    status = error.status() if callable(getattr(error, "status", None)) else None
    # tritonclient formats gRPC codes as "StatusCode.UNAVAILABLE"; stream errors from a model carry no code.
    status = status.split(".", 1)[-1] if status else None
    message = error.message() if callable(getattr(error, "message", None)) else str(error)
    if status == "UNAVAILABLE":
        return TandemConnectionError(url, message or "")
    return TandemError(message or "", status)


def from_rpc_error(error, url: str) -> TandemError:
    """Map a raw grpc.RpcError (grpc.aio raises these directly) to a TandemError."""
    status = error.code().name if error.code() is not None else None
    if status == "UNAVAILABLE":
        return TandemConnectionError(url, error.details() or "")
    return TandemError(error.details() or "", status)


def from_http(http_status: int, body: str) -> TandemError:
    """Map a non-2xx HTTP answer (Triton's body is {"error": msg}, plain or as one SSE event) to a TandemError."""
    from client.response import error_message_from_body  # local: response.py imports this module

    message = error_message_from_body(body) or f"HTTP {http_status}"
    return TandemError(message, _HTTP_TO_TRITON.get(http_status, f"HTTP_{http_status}"), http_status)
