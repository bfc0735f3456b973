"""A client that hangs up while its non-streamed request is generating costs nothing but that
request: the engine drops it and the server logs no error about it."""

from __future__ import annotations

import logging
import socket
import time

import httpx
import pytest
from engine_pace import num_live_requests
from envoy_support import wait_for

LONG = {"prompt": "Hello", "max_tokens": 400, "ignore_eos": True}


def _raw_request(gateway, path: str, body: dict) -> bytes:
    content = httpx.Request("POST", gateway.url + path, json=body).read()
    head = (
        f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        f"content-length: {len(content)}\r\n\r\n"
    )
    return head.encode() + content


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", LONG),
        ("/v1/completions", {**LONG, "prompt": ["Hello", "World"]}),
        ("/v1/chat/completions", {**LONG, "prompt": None, "messages": [{"role": "user",
                                                                       "content": "Hi"}]}),
    ],
)  # fmt: skip
def test_hanging_up_on_a_whole_response_logs_no_error(gateway, slow_engine, caplog, path, body):
    caplog.set_level(logging.WARNING)
    with socket.create_connection(("127.0.0.1", gateway.server.port)) as sock:
        sock.sendall(_raw_request(gateway, path, body))
        wait_for(
            lambda: num_live_requests(slow_engine) >= 1,
            "the request to reach the engine",
            timeout=15.0,
        )
    wait_for(
        lambda: num_live_requests(slow_engine) == 0,
        "the engine to drop the abandoned request",
        timeout=15.0,
    )
    time.sleep(0.5)  # what the gateway logs after the abort, it logs by now
    assert httpx.get(gateway.url + "/health", timeout=10).status_code == 200
    problems = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert not problems, [r.getMessage() + (r.exc_text or "") for r in problems]
