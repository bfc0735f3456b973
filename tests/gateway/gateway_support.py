"""Helpers for the REST gateway tests: gateways started in-process, in front of replicas of the
tiny model, on the event loop thread of ``envoy_support.ServerLoop`` (so the tests' own blocking
calls, the OpenAI SDK's included, never stall the servers)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from collections.abc import Iterator

import httpx
import pytest

from llmrpc.gateway.app import create_app
from llmrpc.gateway.server import GatewayServer
from llmrpc.gateway.settings import (
    ApiSettings,
    BackendSettings,
    CorsSettings,
    GatewaySettings,
    HttpSettings,
)


class RunningGateway:
    def __init__(self, server_loop, settings: GatewaySettings, channels=None) -> None:
        self.server_loop = server_loop
        self.settings = settings
        self.app = create_app(settings, channels)
        self.server = server_loop.run(_make_server(self.app, settings.http))
        server_loop.run(self.server.start())

    @property
    def state(self):
        return self.app.state.gateway

    @property
    def url(self) -> str:
        scheme = "https" if self.settings.http.tls else "http"
        return f"{scheme}://127.0.0.1:{self.server.port}"

    def stop(self) -> None:
        self.server_loop.run(self.server.stop())


async def _make_server(app, http: HttpSettings) -> GatewayServer:
    return GatewayServer(app, http)  # built on the server loop: uvicorn binds to it


def gateway_settings(backends: list[str], **sections) -> GatewaySettings:
    """Settings for a loopback gateway on an OS-chosen port; ``sections`` replace fields:
    ``api={...}``, ``http={...}``, ``cors={...}``, ``backends={...}``."""
    http = HttpSettings(host="127.0.0.1", port=0, uvicorn_log_level="warning")
    parts = {
        "backends": BackendSettings(targets=tuple(backends)),
        "http": http,
        "cors": CorsSettings(),
        "api": ApiSettings(),
    }
    for name, fields in sections.items():
        parts[name] = dataclasses.replace(parts[name], **fields)
    return GatewaySettings(**parts)


@contextlib.contextmanager
def running_gateway(
    server_loop, backends: list[str], channels=None, **sections
) -> Iterator[RunningGateway]:
    """A started gateway; ``channels``: see ``BackendPool``."""
    gateway = RunningGateway(server_loop, gateway_settings(backends, **sections), channels)
    try:
        wait_serving(gateway)
        yield gateway
    finally:
        gateway.stop()


def wait_serving(gateway: RunningGateway, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not gateway.state.pool.serving:
        if time.monotonic() > deadline:
            pytest.fail("the gateway saw no serving replica")
        time.sleep(0.01)


def sse_data(body: bytes) -> list[str]:
    """The ``data:`` payloads of an SSE body, checking OpenAI's exact framing on the way."""
    text = body.decode()
    assert text.endswith("data: [DONE]\n\n"), text[-200:]
    events = text.split("\n\n")[:-1]
    assert all(e.startswith("data: ") and "\n" not in e for e in events), events
    return [e.removeprefix("data: ") for e in events]


def sse_json(body: bytes) -> list[dict]:
    data = sse_data(body)
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def post(gateway: RunningGateway, path: str, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(gateway.url + path, json=body, timeout=60, **kwargs)


def in_process_gateway(server_loop, replica) -> Iterator[RunningGateway]:
    """A gateway in front of ``replica`` through its in-process channel alone (for a module's
    own ``gateway`` fixture, where one way in is enough)."""
    channels = {"in-process": replica.running.loopback}
    with running_gateway(server_loop, ["in-process"], channels=channels) as started:
        yield started
