"""--api-key: every call but health and reflection needs ``authorization: Bearer <key>``;
UNAUTHENTICATED otherwise. Through the Python stubs and grpcurl -H."""

from __future__ import annotations

import json
import logging

import grpc
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from server_utils import bound_server, grpcurl

from llmrpc.v1 import admin_pb2, admin_pb2_grpc, generation_pb2, generation_pb2_grpc

pytestmark = pytest.mark.asyncio(loop_scope="module")

KEYS = ("first-key-0123", "second-key-4567")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def keyed():
    async with bound_server(api_key=KEYS) as running:
        yield running


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def channel(keyed):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{keyed.port}") as channel:
        yield channel


def bearer(value: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", value),)


@pytest.mark.parametrize(
    "metadata",
    [
        (),
        bearer("Bearer wrong-key"),
        bearer(KEYS[0]),
        bearer(f"Basic {KEYS[0]}"),
        bearer("Bearer "),
    ],
    ids=["none", "wrong key", "no scheme", "other scheme", "empty"],
)
async def test_calls_without_a_right_key_are_unauthenticated(channel, metadata):
    admin = admin_pb2_grpc.AdminServiceStub(channel)
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        await admin.GetServerInfo(admin_pb2.GetServerInfoRequest(), metadata=metadata)
    assert failure.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # Refused before anything else: not UNAVAILABLE although no model is loaded.
    generation = generation_pb2_grpc.GenerationServiceStub(channel)
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        await generation.Generate(generation_pb2.GenerateRequest(text="hi"), metadata=metadata)
    assert failure.value.code() == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize("value", [f"Bearer {KEYS[0]}", f"bearer {KEYS[1]}"])
async def test_each_key_is_served(channel, value):
    admin = admin_pb2_grpc.AdminServiceStub(channel)
    info = await admin.GetServerInfo(admin_pb2.GetServerInfoRequest(), metadata=bearer(value))
    assert info.capabilities.auth_required
    assert not any(key in value for key in KEYS for value in info.config.values())


async def test_health_needs_no_key(channel):
    response = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    assert response.status == health_pb2.HealthCheckResponse.NOT_SERVING  # no model loaded


async def test_grpcurl_lists_without_a_key_and_calls_with_dash_h(keyed):
    address = f"127.0.0.1:{keyed.port}"
    method = "llmrpc.v1.AdminService/GetServerInfo"
    rc, out, err = await grpcurl("-plaintext", address, "list")  # reflection: exempt
    assert rc == 0, err
    assert "llmrpc.v1.AdminService" in out.split()
    rc, _, err = await grpcurl("-plaintext", address, method)
    assert rc != 0 and "Unauthenticated" in err
    header = f"authorization: Bearer {KEYS[1]}"
    rc, out, err = await grpcurl("-plaintext", "-H", header, address, method)
    assert rc == 0, err
    assert json.loads(out)["capabilities"]["auth_required"]


async def test_start_up_warns_only_when_neither_key_nor_tls_is_set(caplog):
    with caplog.at_level(logging.WARNING, logger="llmrpc.server.app"):
        async with bound_server():
            pass
        assert any("no --api-key and no TLS" in r.getMessage() for r in caplog.records)
        caplog.clear()
        async with bound_server(api_key=KEYS):
            pass
        assert not any("no --api-key" in r.getMessage() for r in caplog.records)
