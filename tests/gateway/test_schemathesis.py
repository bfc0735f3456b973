"""Schemathesis against the gateway's own OpenAPI schema (FastAPI's /openapi.json), in front of a
real server of the tiny model, as ``llmrpc serve`` runs it (in-process channel).

For every operation, generated requests (valid and invalid ones) must get no 5xx, and responses
must match what the schema says of them (status codes, content types, headers, bodies: the
OpenAI envelope for errors, the answer's own model for a 200). Afterwards the
server must be healthy with nothing left behind: no request running or waiting, every KV block
free. Examples are bounded and derandomized, so a CI run is reproducible.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator

import httpx
import pytest
import schemathesis
from envoy_support import Replica, ServerLoop, tiny_engine_config
from gateway_support import RunningGateway, running_gateway
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode, checks

from llmrpc.clients import Client
from llmrpc.gateway.app import create_app
from llmrpc.gateway.settings import GatewaySettings

# Per operation and mode; LLMRPC_SCHEMATHESIS_EXAMPLES=500 for a deeper run by hand.
MAX_EXAMPLES = int(os.environ.get("LLMRPC_SCHEMATHESIS_EXAMPLES", "25"))
# A short context keeps every generation short, whatever max_tokens and n are drawn.
MAX_MODEL_LEN = 48


@pytest.fixture(scope="module")
def short_replica(server_loop: ServerLoop, tiny_llama_dir) -> Iterator[Replica]:
    config = tiny_engine_config(tiny_llama_dir)
    model = dataclasses.replace(config.model, max_model_len=MAX_MODEL_LEN)
    started = server_loop.start_replica(dataclasses.replace(config, model=model), port=0)
    yield started
    started.stop()


@pytest.fixture(scope="module")
def served(server_loop: ServerLoop, short_replica: Replica) -> Iterator[RunningGateway]:
    channels = {"in-process": short_replica.running.loopback}
    with running_gateway(server_loop, ["in-process"], channels=channels) as gateway:
        yield gateway


def _schema():
    """The gateway's OpenAPI schema, as its default settings build it (the served one is
    checked to be the same)."""
    return schemathesis.openapi.from_dict(create_app(GatewaySettings()).openapi())


OPERATIONS = [result.ok() for result in _schema().get_all_operations()]
# (operation, mode): invalid data only where there is something to get wrong.
CASES = [
    pytest.param(op, mode, id=f"{op.label} {mode.value}")
    for op in OPERATIONS
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
    if mode is GenerationMode.POSITIVE or len(op.body) > 0
]
CHECKS = [
    checks.not_a_server_error,
    checks.status_code_conformance,
    checks.content_type_conformance,
    checks.response_headers_conformance,
    checks.response_schema_conformance,
]
# Not negative_data_rejection: like vLLM, the gateway takes "5" for an integer and "true" for a
# boolean (pydantic's lax mode), which the schema does not allow; clients rely on that.


def test_the_served_schema_is_the_one_tested(served):
    served_schema = httpx.get(served.url + "/openapi.json", timeout=10).json()
    assert served_schema == create_app(GatewaySettings()).openapi()


@pytest.mark.parametrize(("operation", "mode"), CASES)
def test_every_operation_answers_as_its_schema_says(served, operation, mode):
    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=MAX_EXAMPLES,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    def answers_as_documented(case) -> None:
        case.call_and_validate(base_url=served.url, checks=CHECKS, timeout=60)

    answers_as_documented()


def test_the_server_is_healthy_and_holds_nothing_afterwards(served, short_replica):
    assert httpx.get(served.url + "/health", timeout=10).status_code == 200
    with Client(short_replica.address) as client:
        load = client.load(timeout=10)
    assert (load.num_running_requests, load.num_waiting_requests) == (0, 0)
    assert load.kv_cache_usage == 0.0
