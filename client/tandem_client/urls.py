"""Default endpoints, and the protocol and address a URL stands for (its scheme decides; host:port means gRPC)."""
from __future__ import annotations

from urllib.parse import urlsplit

DEFAULT_URLS = {"grpc": "localhost:8001", "http": "localhost:8000"}
DEFAULT_PORTS = {"grpc": 8001, "http": 8000}  # Triton's own defaults
PROTOCOLS = tuple(DEFAULT_URLS)
NAMES = {"grpc": "gRPC", "http": "HTTP"}
SCHEMES = {"http": "http", "https": "http", "grpc": "grpc"}


def check_protocol(protocol: str) -> str:
    if protocol not in DEFAULT_URLS:
        raise ValueError(f"protocol must be one of {', '.join(PROTOCOLS)}, got {protocol!r}")
    return protocol


def scheme_protocol(url: str | None) -> str | None:
    """The protocol a URL's scheme names (http/https → http, grpc → grpc); None for a bare host:port."""
    if not url or "://" not in url:
        return None
    scheme = url.split("://", 1)[0].lower()
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme}:// in {url!r}: use http://, https://, grpc:// or host:port (gRPC)")
    return SCHEMES[scheme]


def resolve(url: str | None, protocol: str | None = None) -> tuple[str, str]:
    """(protocol, address) for a URL and an optional explicit protocol; one that contradicts the scheme is an error.

    http(s)://h:p → HTTP; grpc://h:p or h:p → gRPC, unless `protocol` says HTTP for a bare h:p.
    """
    if protocol is not None:
        check_protocol(protocol)
    named = scheme_protocol(url)
    if protocol is not None and named is not None and protocol != named:
        raise ValueError(f"protocol {protocol} contradicts the URL {url} (its scheme means {NAMES[named]}): "
                         f"leave the protocol out or change the URL")
    protocol = protocol or named or "grpc"
    return protocol, grpc_target(url) if protocol == "grpc" else http_base(url)


def grpc_target(url: str | None) -> str:
    """host:port for grpc; tolerates a scheme ("grpc://h:p", "http://h:p") and a trailing slash."""
    url = url or DEFAULT_URLS["grpc"]
    return url.split("://", 1)[-1].rstrip("/")


def http_base(url: str | None) -> str:
    """http(s)://host:port without a trailing slash."""
    url = (url or DEFAULT_URLS["http"]).rstrip("/")
    return url if "://" in url else f"http://{url}"


def host_port(address: str) -> tuple[str, int | None]:
    """(host, port) of "h:p", "http://h:p/..." or "grpc://h:p"; port None when the address gives none."""
    parts = urlsplit(address if "://" in address else f"//{address}")
    try:
        port = parts.port
    except ValueError:  # not a number: let the transport report it
        port = None
    return parts.hostname or "", port
