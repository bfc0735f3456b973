"""Fixtures of the gateway tests: a thread running the servers' event loop, one gRPC replica of
the tiny model per test module (gateways are cheap: tests start their own in front of it), and
a gateway in front of it over each way in."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from engine_pace import restore_speed, slow_down
from envoy_support import Replica, ServerLoop, tiny_engine_config
from gateway_support import RunningGateway, in_process_gateway, running_gateway

from llmrpc.clients import Client


@pytest.fixture(scope="module")
def server_loop() -> Iterator[ServerLoop]:
    server_loop = ServerLoop()
    yield server_loop
    server_loop.close()


@pytest.fixture(scope="module")
def replica(server_loop: ServerLoop, tiny_llama_dir: Path) -> Iterator[Replica]:
    started = server_loop.start_replica(tiny_engine_config(tiny_llama_dir), port=0)
    yield started
    started.stop()


@pytest.fixture
def slow_engine(replica: Replica):
    """The replica's engine with steps of at least 20 ms, so a long request stays live."""
    engine = replica.running.engine
    slow_down(engine, 0.02)
    yield engine
    restore_speed(engine)


@pytest.fixture(scope="module", params=["network", "in-process"])
def gateway(request, server_loop: ServerLoop, replica: Replica) -> Iterator[RunningGateway]:
    """A gateway in front of the replica: over gRPC to its port (``llmrpc gateway``), then
    through its in-process channel (as ``llmrpc serve`` runs it)."""
    if request.param == "network":
        started = running_gateway(server_loop, [replica.address])
        with started as gateway:
            yield gateway
    else:
        yield from in_process_gateway(server_loop, replica)


@pytest.fixture(scope="module")
def sdk(gateway: RunningGateway) -> openai.OpenAI:
    """The OpenAI SDK against the module's gateway."""
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def grpc_client(replica: Replica) -> Iterator[Client]:
    """The Python gRPC client against the module's replica."""
    with Client(replica.address) as client:
        yield client
