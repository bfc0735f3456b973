"""The REST listener's connections are bounded: a connection must send each request head within
--request-header-timeout (TLS handshake included), idle keep-alive connections close after
--rest-keep-alive-timeout, and past --rest-max-connections new connections are closed as they
are accepted while the ones held are served on. A slow streamed response is never cut."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator

import pytest
from tls_certs import CertificateAuthority

from llmrpc.gateway.server import GatewayServer
from llmrpc.gateway.settings import HttpSettings

GET = b"GET / HTTP/1.1\r\nhost: x\r\n\r\n"


async def app(scope, receive, send) -> None:
    """Answers 200 "ok"; /slow streams three chunks a quarter second apart."""
    if scope["type"] == "lifespan":
        while (message := await receive())["type"] != "lifespan.shutdown":
            await send({"type": message["type"] + ".complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    if scope["path"] != "/slow":
        headers = [(b"content-length", b"2")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"ok"})
        return
    await send({"type": "http.response.start", "status": 200, "headers": []})  # chunked
    for _ in range(3):
        await asyncio.sleep(0.25)
        await send({"type": "http.response.body", "body": b"tick", "more_body": True})
    await send({"type": "http.response.body", "body": b""})


@contextlib.asynccontextmanager
async def listening(**fields) -> AsyncIterator[GatewayServer]:
    http = HttpSettings(host="127.0.0.1", port=0, disable_uvicorn_access_log=True, **fields)
    server = GatewayServer(app, http)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


async def closed_within(reader: asyncio.StreamReader, seconds: float) -> bytes | None:
    """What the server sent before it closed the connection; None if still open after
    ``seconds``."""
    received = b""

    async def read_to_the_end() -> None:
        nonlocal received
        while chunk := await reader.read(65536):
            received += chunk

    try:
        await asyncio.wait_for(read_to_the_end(), seconds)
    except asyncio.TimeoutError:
        return None
    except ConnectionResetError:
        pass
    return received


async def test_a_connection_that_sends_nothing_is_closed_at_the_header_timeout():
    async with listening(header_timeout_s=0.5) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        assert await closed_within(reader, 5) == b""
        writer.close()


async def test_a_trickled_request_head_gets_408_at_the_header_timeout():
    async with listening(header_timeout_s=0.5) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        for piece in (b"GET / HTTP/1.1\r\n", b"host: x\r\n"):
            writer.write(piece)
            await asyncio.sleep(0.2)
        answer = await closed_within(reader, 5)
        assert answer is not None and answer.startswith(b"HTTP/1.1 408 ")
        writer.close()


async def test_the_next_head_on_a_kept_alive_connection_has_the_same_bound():
    async with listening(header_timeout_s=0.5, keep_alive_timeout_s=30) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(GET)
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 ")
        assert await reader.readexactly(2) == b"ok"
        writer.write(b"GET / HTTP/1.1\r\n")  # the start of a second request, never finished
        answer = await closed_within(reader, 5)
        assert answer is not None and answer.startswith(b"HTTP/1.1 408 ")
        writer.close()


async def test_an_idle_kept_alive_connection_closes_at_the_keep_alive_timeout():
    async with listening(header_timeout_s=30, keep_alive_timeout_s=0.5) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(GET)
        await reader.readuntil(b"ok")
        assert await closed_within(reader, 5) == b""
        writer.close()


async def test_a_streamed_response_longer_than_the_header_timeout_is_not_cut():
    async with listening(header_timeout_s=0.3) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /slow HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        answer = await closed_within(reader, 10)
        assert answer is not None and answer.count(b"tick") == 3
        assert answer.endswith(b"\r\n0\r\n\r\n")  # the last chunk: the whole response
        writer.close()


async def test_connections_past_the_cap_are_closed_at_accept_and_held_ones_are_served():
    async with listening(max_connections=3, header_timeout_s=30) as server:
        held = [await asyncio.open_connection("127.0.0.1", server.port) for _ in range(3)]
        await asyncio.sleep(0.1)  # accepted
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        assert await closed_within(reader, 5) == b""  # closed at once, nothing read or sent
        writer.close()
        for held_reader, held_writer in held:  # the connections held are served
            held_writer.write(GET)
            assert (await held_reader.readuntil(b"ok")).startswith(b"HTTP/1.1 200 ")
        held[0][1].close()
        await asyncio.sleep(0.2)  # the server sees the close
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(GET)
        assert (await reader.readuntil(b"ok")).startswith(b"HTTP/1.1 200 ")
        for _, held_writer in (*held[1:], (reader, writer)):
            held_writer.close()
        assert server.connections.num_refused == 1


async def test_a_tls_connection_that_never_handshakes_is_closed_at_the_header_timeout(tmp_path):
    authority = CertificateAuthority(tmp_path)
    identity = authority.issue("server", server=True)
    tls = {"ssl_certfile": str(identity.cert), "ssl_keyfile": str(identity.key)}
    async with listening(header_timeout_s=0.5, **tls) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)  # no TLS
        assert await closed_within(reader, 5) == b""
        writer.close()
        client = ssl.create_default_context(cafile=str(authority.cert))
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", server.port, ssl=client, server_hostname="localhost"
        )
        writer.write(GET)
        assert (await reader.readuntil(b"ok")).startswith(b"HTTP/1.1 200 ")
        writer.close()


@pytest.mark.parametrize(
    ("fields", "flag"),
    [
        ({"max_connections": 0}, "--rest-max-connections"),
        ({"header_timeout_s": 0}, "--request-header-timeout"),
        ({"keep_alive_timeout_s": -1}, "--rest-keep-alive-timeout"),
    ],
)
def test_bad_values_name_their_flag(fields, flag):
    with pytest.raises(ValueError, match=flag):
        HttpSettings(**fields)
