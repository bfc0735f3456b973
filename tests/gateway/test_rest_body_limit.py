"""The REST request-body limit and read timeout: a declared length over the limit is refused
before the body, a chunked body as soon as it passes the limit, a trickled body after the read
timeout, each in OpenAI's envelope; /health keeps answering while a huge body arrives; and the
flags (``--max-request-body-size``, ``--request-body-timeout``) reach the gateway."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time

import httpx
import pytest
from gateway_support import running_gateway

from llmrpc import cli
from llmrpc.cli.rest import gateway_settings
from llmrpc.gateway import cli as gateway_cli
from llmrpc.gateway.settings import HttpSettings
from llmrpc.server import options

MIB = 1024 * 1024
LIMIT = 4096
PATH = "/v1/completions"


@pytest.fixture(scope="module")
def small(server_loop, replica):
    """A gateway taking bodies of at most LIMIT bytes, read within one second."""
    http = {"max_request_body_size": LIMIT, "request_body_timeout_s": 1.0}
    with running_gateway(server_loop, [replica.address], http=http) as gateway:
        yield gateway


def _connect(gateway) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", gateway.server.port), timeout=30)
    return sock


def _head(length: int | None) -> bytes:
    framing = f"content-length: {length}" if length is not None else "transfer-encoding: chunked"
    return (
        f"POST {PATH} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        f"{framing}\r\n\r\n"
    ).encode()


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _read_reply(sock: socket.socket) -> tuple[int, dict, bytes]:
    """(status, headers, body) of one response; the server closes the connection after it."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, body


def _assert_error(status: int, body: bytes, expected: int) -> None:
    assert status == expected, body
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]


def _send_quietly(sock: socket.socket, data: bytes) -> bool:
    """Send; False once the server has closed its side (it answered already)."""
    try:
        sock.sendall(data)
    except (BrokenPipeError, ConnectionResetError):
        return False
    return True


def test_a_declared_length_over_the_default_limit_is_refused_before_the_body(gateway):
    with _connect(gateway) as sock:
        sock.sendall(_head(16 * MIB + 1))  # the gRPC receive limit's default, plus one
        status, headers, body = _read_reply(sock)
    _assert_error(status, body, 413)
    assert headers.get("connection") == "close"


def test_a_chunked_body_over_the_limit_is_refused_as_it_arrives(small):
    with _connect(small) as sock:
        sock.sendall(_head(None))
        for _ in range(LIMIT // 1000 + 1):  # just past the limit, and the body never ends
            sock.sendall(_chunk(b"x" * 1000))
        status, _, body = _read_reply(sock)
    _assert_error(status, body, 413)


def test_a_body_at_the_limit_is_served(small):
    body = json.dumps({"prompt": "Hello", "max_tokens": 1})
    content = (body + " " * (LIMIT - len(body))).encode()  # JSON whitespace: no unknown field
    assert len(content) == LIMIT
    headers = {"content-type": "application/json"}
    reply = httpx.post(small.url + PATH, content=content, headers=headers, timeout=60)
    assert reply.status_code == 200, reply.text
    reply = httpx.post(small.url + PATH, content=content + b" ", headers=headers, timeout=60)
    assert reply.status_code == 413, reply.text


def test_a_trickled_body_is_cut_off_after_the_read_timeout(small):
    started = time.monotonic()
    with _connect(small) as sock:
        sock.sendall(_head(100) + b'{"prompt": ')
        for _ in range(3):  # a byte now and then, never the whole body
            time.sleep(0.2)
            sock.sendall(b" ")
        status, headers, body = _read_reply(sock)
    _assert_error(status, body, 408)
    assert headers.get("connection") == "close"
    assert time.monotonic() - started < 30  # cut off, not left to trickle on for minutes


def test_health_answers_while_a_huge_body_arrives(gateway):
    outcome: dict = {"sent": 0, "status": None}

    def send_huge_body() -> None:
        with _connect(gateway) as sock:
            sock.sendall(_head(None) + _chunk(b'{"prompt": "'))
            chunk = _chunk(b"a" * MIB)
            while outcome["sent"] < 100 and _send_quietly(sock, chunk):  # 100 MB, at full speed
                outcome["sent"] += 1
            # A reset: the server closed with our data unread, cutting us off.
            with contextlib.suppress(ConnectionResetError):
                outcome["status"], _, outcome["body"] = _read_reply(sock)

    sender = threading.Thread(target=send_huge_body)
    sender.start()
    probes = 0
    while sender.is_alive() or probes < 3:
        assert httpx.get(gateway.url + "/health", timeout=10).status_code == 200
        probes += 1
        time.sleep(0.05)
    sender.join()
    if outcome["status"] is None:  # the reply was lost to the reset; the cut-off was not
        assert outcome["sent"] < 100
    else:
        _assert_error(outcome["status"], outcome["body"], 413)


# --- flags ------------------------------------------------------------------------------------


def _serve_http(*argv: str) -> HttpSettings:
    parser = cli.build_parser()[1]
    _, frontend = options.build_configs(options.parse_serve_values(parser, ["m", *argv]))
    return gateway_settings(frontend).http


def test_serve_flags_set_the_limit_and_the_timeout():
    assert _serve_http().max_request_body_size == 16 * MIB  # the gRPC receive limit's
    assert _serve_http("--grpc-max-receive-message-size", "8M").max_request_body_size == 8 * MIB
    http = _serve_http("--max-request-body-size", "1M", "--request-body-timeout", "5")
    assert (http.max_request_body_size, http.request_body_timeout_s) == (MIB, 5.0)
    with pytest.raises(ValueError, match="--max-request-body-size"):
        _serve_http("--max-request-body-size", "0")


def test_gateway_flags_set_the_limit_and_the_timeout():
    parser = gateway_cli.build_parser()
    args = parser.parse_args(["--backend", "x:1", "--max-request-body-size", "2048"])
    assert gateway_cli.settings_from_args(args).http.max_request_body_size == 2048
    args = parser.parse_args(["--backend", "x:1", "--request-body-timeout", "2.5"])
    http = gateway_cli.settings_from_args(args).http
    assert http.request_body_timeout_s == 2.5 and http.body_limit == 16 * MIB
    with pytest.raises(ValueError, match="--request-body-timeout"):
        HttpSettings(request_body_timeout_s=0)
