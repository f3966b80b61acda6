"""Default endpoints and URL normalisation for both protocols."""
from __future__ import annotations

DEFAULT_URLS = {"grpc": "localhost:8001", "http": "localhost:8000"}
PROTOCOLS = tuple(DEFAULT_URLS)


def check_protocol(protocol: str) -> str:
    if protocol not in DEFAULT_URLS:
        raise ValueError(f"protocol must be one of {', '.join(PROTOCOLS)}, got {protocol!r}")
    return protocol


def grpc_target(url: str | None) -> str:
    """host:port for grpc; tolerates a scheme ("grpc://h:p", "http://h:p") and a trailing slash."""
    url = url or DEFAULT_URLS["grpc"]
    return url.split("://", 1)[-1].rstrip("/")


def http_base(url: str | None) -> str:
    """http(s)://host:port without a trailing slash."""
    url = (url or DEFAULT_URLS["http"]).rstrip("/")
    return url if "://" in url else f"http://{url}"
