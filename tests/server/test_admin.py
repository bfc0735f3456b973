"""AdminService, health and reflection of an in-process server (tiny model)."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from llmrpc.server.app import RunningServer
from llmrpc.v1 import admin_pb2

pytestmark = pytest.mark.asyncio(loop_scope="module")

V1_SERVICES = {
    "llmrpc.v1.GenerationService",
    "llmrpc.v1.TokenizationService",
    "llmrpc.v1.AdminService",
}


async def test_server_info_has_version_capabilities_and_config(admin, server: RunningServer):
    info = await admin.GetServerInfo(admin_pb2.GetServerInfoRequest())
    assert info.version == "0.1.0"
    assert info.api_version == "v1"
    assert V1_SERVICES | {"grpc.health.v1.Health"} <= set(info.capabilities.services)
    assert info.capabilities.prefix_caching
    assert not info.capabilities.tls
    assert info.config["grpc_port"] == str(server.port)
    assert info.config["dtype"] == "float32"
    assert info.config["max_model_len"] == "512"
    assert info.config["num_gpu_blocks_override"] == "256"


async def test_model_info_and_list_models(admin, server: RunningServer):
    name = server.engine.model_info.served_model_names[0]
    info = await admin.GetModelInfo(admin_pb2.GetModelInfoRequest())
    assert info.model == name
    assert info.max_model_len == 512
    assert info.vocab_size == len(server.engine.tokenizer)
    assert list(info.eos_token_ids) == [server.engine.tokenizer.eos_token_id]
    assert info.has_chat_template
    assert info.num_kv_blocks == 256
    assert info.default_stopping.max_tokens == 16
    assert info.default_sampling.temperature == 1.0
    assert info.default_output.skip_special_tokens
    assert (await admin.GetModelInfo(admin_pb2.GetModelInfoRequest(model=name))).model == name
    models = await admin.ListModels(admin_pb2.ListModelsRequest())
    assert [(m.id, m.max_model_len, m.owned_by) for m in models.models] == [(name, 512, "llmrpc")]


async def test_model_info_unknown_model_is_not_found(admin):
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        await admin.GetModelInfo(admin_pb2.GetModelInfoRequest(model="nope"))
    assert failure.value.code() == grpc.StatusCode.NOT_FOUND


async def test_health_serving_for_the_server_and_each_service(channel):
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", *V1_SERVICES):
        response = await health.Check(health_pb2.HealthCheckRequest(service=service))
        assert response.status == health_pb2.HealthCheckResponse.SERVING, service


async def test_reflection_lists_every_service(channel):
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    async for response in stub.ServerReflectionInfo(iter([request])):
        names = {s.name for s in response.list_services_response.service}
        break
    assert names == V1_SERVICES | {
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
    }
