"""Which protocol each URL form means, the error for a contradicting protocol flag, and what the CLI says (and
exits with) when nothing answers; no server needed."""
from __future__ import annotations

import asyncio
import socket

import pytest

from tandem_client import AsyncClient, Client, TandemConnectionError
from tandem_client.cli import EXIT_UNREACHABLE, EXIT_USAGE, main
from tandem_client.errors import unreachable_hint
from tandem_client.urls import resolve


@pytest.mark.parametrize("url,protocol,expected", [
    (None, None, ("grpc", "localhost:8001")),
    (None, "http", ("http", "http://localhost:8000")),
    ("h:1", None, ("grpc", "h:1")),
    ("grpc://h:1/", None, ("grpc", "h:1")),
    ("http://h:1", None, ("http", "http://h:1")),
    ("https://h:1/", None, ("http", "https://h:1")),
    ("h:1", "http", ("http", "http://h:1")),
    ("http://h:1", "http", ("http", "http://h:1")),
    ("grpc://h:1", "grpc", ("grpc", "h:1")),
])
def test_the_scheme_decides_the_protocol(url, protocol, expected):
    assert resolve(url, protocol) == expected
    with Client(url, protocol) as client:  # no connection is made until a request
        assert (client.protocol, client.url) == expected

    async def async_protocol():
        async with AsyncClient(url, protocol) as aclient:
            return aclient.protocol, aclient.url

    assert asyncio.run(async_protocol()) == expected


@pytest.mark.parametrize("url,protocol,message", [
    ("http://h:1", "grpc", "protocol grpc contradicts the URL http://h:1 (its scheme means HTTP)"),
    ("grpc://h:1", "http", "protocol http contradicts the URL grpc://h:1 (its scheme means gRPC)"),
    ("ftp://h:1", None, "unknown scheme ftp://"),
    ("h:1", "udp", "protocol must be one of grpc, http"),
])
def test_a_contradicting_or_unknown_protocol_is_an_error(url, protocol, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve(url, protocol)


def test_hints_name_triton_s_other_default_port():
    assert unreachable_hint("grpc", "localhost:8000") == (
        "port 8000 is Triton's default HTTP port: for HTTP use http://localhost:8000, for gRPC localhost:8001")
    assert unreachable_hint("http", "localhost:8001") == (
        "port 8001 is Triton's default gRPC port: for gRPC use localhost:8001, for HTTP http://localhost:8000")
    assert "nothing listens on port 5" in unreachable_hint("grpc", "h:5", "Connection refused")
    # gRPC against an HTTP/1 port: the server closes the socket; HTTP/1 against a gRPC port: an HTTP/2 frame
    assert "port 5 answers, but not in gRPC: an HTTP port? for HTTP use http://h:5" in unreachable_hint(
        "grpc", "h:5", "ipv4:127.0.0.1:5: Socket closed")
    assert "for gRPC use h:5" in unreachable_hint("http", "h:5", "BadStatusLine: the answer is not HTTP/1")
    err = TandemConnectionError("h:5", "Connection refused", "http")
    assert err.message.startswith("cannot reach Triton over HTTP at h:5: nothing listens on port 5")


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("url,name", [("127.0.0.1:{port}", "gRPC"), ("grpc://127.0.0.1:{port}", "gRPC"),
                                      ("http://127.0.0.1:{port}", "HTTP")])
def test_cli_names_protocol_and_port_when_nothing_answers(capsys, url, name):
    port = closed_port()
    assert main(["hi", "--url", url.format(port=port), "--max-tokens", "2"]) == EXIT_UNREACHABLE == 3
    err = capsys.readouterr().err
    assert f"error: cannot reach Triton over {name} at 127.0.0.1:{port}: nothing listens on port {port}" in err


def test_cli_refuses_a_protocol_that_contradicts_the_url(capsys):
    assert main(["hi", "--url", "http://127.0.0.1:1", "--protocol", "grpc"]) == EXIT_USAGE == 2
    assert "error: protocol grpc contradicts the URL http://127.0.0.1:1" in capsys.readouterr().err
