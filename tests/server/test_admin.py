"""AdminService, health and reflection of an in-process server (tiny model, sleep mode on)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import grpc
import pytest
import pytest_asyncio
from engine_pace import num_live_requests, restore_speed, slow_down
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from server_utils import (
    field_violations,
    frontend_config,
    status_detail,
    tiny_engine_config,
    wait_until,
)

from llmrpc.kernels import attention_tuning
from llmrpc.server.app import RunningServer, start_server
from llmrpc.v1 import admin_pb2, common_pb2, generation_pb2

pytestmark = pytest.mark.asyncio(loop_scope="module")

V1_SERVICES = {
    "llmrpc.v1.GenerationService",
    "llmrpc.v1.TokenizationService",
    "llmrpc.v1.AdminService",
    "llmrpc.v1.EmbeddingService",
    "inference.GRPCInferenceService",  # KServe v2, on the same port
    "vllm.grpc.engine.VllmEngine",  # vLLM's engine service, as the smg router calls it
}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(tiny_llama_dir, engine_mode) -> AsyncIterator[RunningServer]:
    """The module's server, with --enable-sleep-mode."""
    engine_config = tiny_engine_config(tiny_llama_dir, enable_sleep_mode=True)
    running = await start_server(engine_config, frontend=frontend_config(engine_mode))
    yield running
    await running.stop(grace=0)


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
    device = server.engine.device
    assert info.capabilities.device == device and device.split(":")[0] in ("cpu", "cuda")
    assert info.capabilities.kv_cache_bytes == 256 * 2 * 2 * 16 * 2 * 16 * 4
    assert (info.capabilities.device_memory_total_bytes > 0) == (device != "cpu")
    if device != "cpu":
        assert not info.kernels
        return
    # the tiny model's float32 linear shapes, each with a kernel per bucket of rows, chosen
    # among the candidates timed here: the fastest of the layout the shape keeps
    vocab = len(server.tokenization.tokenizer)
    shapes = {"64x128", "64x64", "64x256", "128x64", f"64x{vocab}"}  # qkv, o, gate_up, down, head
    linear = [k for k in info.kernels if k.op.startswith("linear ")]
    assert {k.op.removeprefix("linear float32 ") for k in linear} == shapes
    for op in {k.op for k in linear}:
        rows = [k.rows for k in linear if k.op == op]
        assert rows == ["1", "2-8", "9-32", "33-128", "129-1024", "1025+"]
    for choice in linear:
        assert choice.kernel == "onednn" and choice.num_layers >= 1  # the float32 candidate
        if choice.times_us:
            assert choice.kernel in choice.times_us
    # a prompt chunk's attention (its 4 query heads over 2 KV heads of 16), by the chunk's rows
    # from two: the faster of the C++ kernel and torch's, both timed here
    attention = [k for k in info.kernels if k.op.startswith("prefill attention ")]
    assert {k.op for k in attention} == {"prefill attention 4/2x16 heads, blocks of 16, float32"}
    assert [k.rows for k in attention] == ["2-8", "9-32", "33-128", "129-1024", "1025+"]
    for choice in attention:
        assert set(choice.times_us) == {"cpp-prefill", "torch-sdpa"} and choice.num_layers == 2
        assert choice.kernel == min(choice.times_us, key=choice.times_us.get)
    # a step's decode rows, by their number from one: the faster of the two (torch's by a
    # margin), timed up to 1024 rows (more take the 129-1024 bucket's choice)
    decode = [k for k in info.kernels if k.op.startswith("decode attention ")]
    assert {k.op for k in decode} == {"decode attention 4/2x16 heads, blocks of 16, float32"}
    assert [k.rows for k in decode] == ["1", "2-8", "9-32", "33-128", "129-1024", "1025+"]
    edge = {"cpp-decode": attention_tuning.DECODE_EDGE, "torch-sdpa": 1.0}
    for choice in decode[:-1]:
        assert set(choice.times_us) == {"cpp-decode", "torch-sdpa"} and choice.num_layers == 2
        assert choice.kernel == min(edge, key=lambda k, c=choice: c.times_us[k] * edge[k])
    assert not decode[-1].times_us and decode[-1].kernel == decode[-2].kernel
    assert len(info.kernels) == len(linear) + len(attention) + len(decode)


async def test_model_info_and_list_models(admin, server: RunningServer):
    name = server.engine.model_info.served_model_names[0]
    info = await admin.GetModelInfo(admin_pb2.GetModelInfoRequest())
    assert info.model == name
    assert info.max_model_len == 512
    assert info.vocab_size == len(server.tokenization.tokenizer)
    assert list(info.eos_token_ids) == [server.tokenization.tokenizer.eos_token_id]
    assert info.has_chat_template
    assert info.num_kv_blocks == 256
    assert info.default_stopping.max_tokens == 16
    assert info.default_sampling.temperature == 1.0
    assert info.default_output.skip_special_tokens
    assert info.runner == admin_pb2.GetModelInfoResponse.RUNNER_GENERATE
    assert not info.HasField("embedding_size")  # a generating model makes no embeddings
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


REFLECTION_SERVICES = {
    "grpc.reflection.v1.ServerReflection",
    "grpc.reflection.v1alpha.ServerReflection",
}


async def test_reflection_lists_every_service(channel):
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    async for response in stub.ServerReflectionInfo(iter([request])):
        names = {s.name for s in response.list_services_response.service}
        break
    assert names == V1_SERVICES | {"grpc.health.v1.Health"} | REFLECTION_SERVICES


async def _ask_reflection_v1(channel, requests):
    """The answers of ``grpc.reflection.v1`` alone, as a client that knows no v1alpha asks it
    (v1's messages are v1alpha's field for field: the same bytes on the wire)."""
    call = channel.stream_stream(
        "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
        request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
        response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
    )
    return [response async for response in call(iter(requests))]


async def test_reflection_v1_answers_a_client_that_asks_v1_only(channel):
    from google.protobuf import descriptor_pb2

    listed, generation, itself, missing = await _ask_reflection_v1(
        channel,
        [
            reflection_pb2.ServerReflectionRequest(list_services=""),
            reflection_pb2.ServerReflectionRequest(
                file_containing_symbol="llmrpc.v1.GenerationService"
            ),
            reflection_pb2.ServerReflectionRequest(
                file_containing_symbol="grpc.reflection.v1.ServerReflection"
            ),
            reflection_pb2.ServerReflectionRequest(file_containing_symbol="no.Such"),
        ],
    )
    names = {s.name for s in listed.list_services_response.service}
    assert names == V1_SERVICES | {"grpc.health.v1.Health"} | REFLECTION_SERVICES

    def files(response) -> dict[str, descriptor_pb2.FileDescriptorProto]:
        protos = response.file_descriptor_response.file_descriptor_proto
        parsed = [descriptor_pb2.FileDescriptorProto.FromString(raw) for raw in protos]
        return {proto.name: proto for proto in parsed}

    generation_file = files(generation)["llmrpc/v1/generation.proto"]
    assert "GenerationService" in [service.name for service in generation_file.service]
    (reflection_file,) = files(itself).values()
    assert reflection_file.package == "grpc.reflection.v1"
    (method,) = reflection_file.service[0].method
    assert method.input_type == ".grpc.reflection.v1.ServerReflectionRequest"
    assert missing.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]


# --- load, prefix cache, sleep -----------------------------------------------------------------


def greedy(text: str = "The quick brown fox", max_tokens: int = 8):
    return generation_pb2.GenerateRequest(
        text=text,
        sampling=common_pb2.SamplingParams(temperature=0.0),
        stopping=common_pb2.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True),
    )


@contextlib.asynccontextmanager
async def live_stream(generation, server, monkeypatch):
    """A slow stream in flight (its first message read) for the duration of the block."""
    slow_down(server.engine, 0.02)
    call = generation.GenerateStream(greedy(max_tokens=200))
    await call.read()
    try:
        yield call
    finally:
        call.cancel()
        restore_speed(server.engine)
        await wait_until(lambda: num_live_requests(server.engine) == 0, what="the abort")


async def test_load_reports_requests_kv_usage_and_throughput(
    admin, generation, server, monkeypatch
):
    idle = await admin.GetLoad(admin_pb2.GetLoadRequest())
    assert (idle.num_running_requests, idle.num_waiting_requests) == (0, 0)
    assert idle.num_kv_blocks == 256 and idle.kv_cache_usage == 0.0 and not idle.is_sleeping
    # the tiny model: 2 layers x keys and values x 16 tokens x 2 KV heads x 16 dims x 4 bytes
    assert idle.kv_cache_bytes == 256 * 2 * 2 * 16 * 2 * 16 * 4
    if server.engine.device == "cpu":  # no device memory, and no utilization field at all
        assert (idle.device_memory_used_bytes, idle.device_memory_total_bytes) == (0, 0)
        assert not idle.HasField("device_utilization")
    else:
        assert 0 < idle.device_memory_used_bytes <= idle.device_memory_total_bytes
    async with live_stream(generation, server, monkeypatch):
        busy = await admin.GetLoad(admin_pb2.GetLoadRequest())
    assert busy.num_running_requests == 1
    assert 0 < busy.kv_cache_usage < 1
    assert busy.generation_throughput > 0 and busy.prompt_throughput > 0


async def test_reset_prefix_cache_forgets_cached_prompts(admin, generation, server, monkeypatch):
    request = greedy(text="Prefix caching reuses the blocks of a prompt seen before. " * 3)
    await generation.Generate(request)
    assert (await generation.Generate(request)).usage.cached_tokens > 0
    await admin.ResetPrefixCache(admin_pb2.ResetPrefixCacheRequest())
    assert (await generation.Generate(request)).usage.cached_tokens == 0
    async with live_stream(generation, server, monkeypatch):
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            await admin.ResetPrefixCache(admin_pb2.ResetPrefixCacheRequest())
    assert failure.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert status_detail(failure.value, error_details_pb2.PreconditionFailure).violations


async def test_sleep_refuses_generation_until_wake_up(admin, generation):
    before = await generation.Generate(greedy())
    await admin.Sleep(admin_pb2.SleepRequest(level=2))  # drops the weights too
    assert (await admin.IsSleeping(admin_pb2.IsSleepingRequest())).is_sleeping
    asleep = await admin.GetLoad(admin_pb2.GetLoadRequest())
    assert asleep.is_sleeping and asleep.kv_cache_bytes == 0
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        await generation.Generate(greedy())
    assert failure.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    await admin.WakeUp(admin_pb2.WakeUpRequest())
    assert not (await admin.IsSleeping(admin_pb2.IsSleepingRequest())).is_sleeping
    assert (await generation.Generate(greedy())).token_ids == before.token_ids  # weights back


async def test_sleep_needs_an_idle_engine_and_a_known_level(admin, generation, server, monkeypatch):
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        await admin.Sleep(admin_pb2.SleepRequest(level=3))
    assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field_violations(failure.value) == ["level"]
    async with live_stream(generation, server, monkeypatch):
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            await admin.Sleep(admin_pb2.SleepRequest())
    assert failure.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert not (await admin.IsSleeping(admin_pb2.IsSleepingRequest())).is_sleeping
