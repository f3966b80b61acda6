"""Exceptions the client raises, and the mapping from transport errors to them."""
from __future__ import annotations

from tandem_client.urls import DEFAULT_PORTS, NAMES, host_port

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
    """The server could not be reached at all (not started, wrong port or protocol, network down)."""

    def __init__(self, url: str, detail: str = "", protocol: str | None = None):
        where = f"over {NAMES[protocol]} at {url}" if protocol else f"at {url}"
        hint = unreachable_hint(protocol, url, detail) if protocol else ""
        super().__init__(f"cannot reach Triton {where}" + (f": {hint}" if hint else "")
                         + (f" ({detail})" if detail else ""), "UNAVAILABLE")
        self.url, self.protocol, self.hint = url, protocol, hint


def unreachable_hint(protocol: str, url: str, detail: str = "") -> str:
    """What to try, from the port and how the connection failed (refused, or answered in the other protocol)."""
    host, port = host_port(url)
    other = "http" if protocol == "grpc" else "grpc"
    where = f"port {port}" if port is not None else "the default port (no port given)"
    if port == DEFAULT_PORTS[other]:
        this = _example(protocol, host, DEFAULT_PORTS[protocol])
        return (f"port {port} is Triton's default {NAMES[other]} port: for {NAMES[other]} use "
                f"{_example(other, host, port)}, for {NAMES[protocol]} {this}")
    if "refused" in detail.lower():
        return (f"nothing listens on {where}: is the server up? `make serve` starts one "
                f"(HTTP on {DEFAULT_PORTS['http']}, gRPC on {DEFAULT_PORTS['grpc']})")
    # gRPC to an HTTP/1 port: the server closes the socket; HTTP/1 to a gRPC port: an HTTP/2 frame, not a status line
    if ("Socket closed" in detail and protocol == "grpc") or ("BadStatusLine" in detail and protocol == "http"):
        article = "an" if other == "http" else "a"
        return (f"{where} answers, but not in {NAMES[protocol]}: {article} {NAMES[other]} port? "
                f"for {NAMES[other]} use {_example(other, host, port)}")
    return (f"is the server up, and is {where} its {NAMES[protocol]} port? Triton listens for HTTP on "
            f"{DEFAULT_PORTS['http']} and gRPC on {DEFAULT_PORTS['grpc']}; an http:// URL selects HTTP")


def connection_detail(error: Exception) -> str:
    """A short cause for an HTTP library's connection error (its own text can run to hundreds of characters)."""
    text = str(error)
    if "refused" in text.lower():
        return "connection refused"
    if "BadStatusLine" in text:
        return "BadStatusLine: the answer is not HTTP/1"
    return type(error).__name__


def _example(protocol: str, host: str, port: int | None) -> str:
    address = f"{host}:{port}" if port is not None else host
    return f"http://{address}" if protocol == "http" else address


def from_grpc(error, url: str) -> TandemError:
    """Map a tritonclient InferenceServerException (sync or aio) to a TandemError."""
    status = error.status() if callable(getattr(error, "status", None)) else None
    # tritonclient formats gRPC codes as "StatusCode.UNAVAILABLE"; stream errors from a model carry no code.
    status = status.split(".", 1)[-1] if status else None
    message = error.message() if callable(getattr(error, "message", None)) else str(error)
    if status == "UNAVAILABLE":
        return TandemConnectionError(url, message or "", "grpc")
    return TandemError(message or "", status)


def from_rpc_error(error, url: str) -> TandemError:
    """Map a raw grpc.RpcError (grpc.aio raises these directly) to a TandemError."""
    status = error.code().name if error.code() is not None else None
    if status == "UNAVAILABLE":
        return TandemConnectionError(url, error.details() or "", "grpc")
    return TandemError(error.details() or "", status)


def from_http(http_status: int, body: str) -> TandemError:
    """Map a non-2xx HTTP answer (Triton's body is {"error": msg}, plain or as one SSE event) to a TandemError."""
    from tandem_client.response import error_message_from_body  # local: response.py imports this module

    message = error_message_from_body(body) or f"HTTP {http_status}"
    return TandemError(message, _HTTP_TO_TRITON.get(http_status, f"HTTP_{http_status}"), http_status)
