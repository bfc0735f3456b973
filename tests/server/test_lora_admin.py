"""LoRA over gRPC: AdminService's Load/Unload/ListLoraAdapters with their status codes, the
``lora`` field of generation, adapters in ListModels, and unloading while requests run (the
engine core in a process of its own, so the errors cross the process boundary as they do in
``llmrpc serve``)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

import grpc
import pytest
import pytest_asyncio
from google.rpc import error_details_pb2
from lora_adapters import AdapterSpec, greedy_tokens, make_adapter
from server_utils import field_violations, frontend_config, status_detail, tiny_engine_config

from llmrpc.engine.lora.types import LoRAConfig, LoRAModulePath
from llmrpc.server.app import RunningServer, start_server
from llmrpc.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    common_pb2,
    generation_pb2,
    generation_pb2_grpc,
    tokenization_pb2,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMPT = [1, 504, 3458, 314, 260, 3575, 282]
MAX_TOKENS = 6
LONG = 160  # tokens of the requests running while their adapter is unloaded


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory):
    """name -> (folder, PEFT's merged model's greedy tokens for PROMPT)."""
    made = {}
    specs = {"first": AdapterSpec(rank=8, alpha=16, seed=11), "second": AdapterSpec(4, 4, seed=12)}
    for name, spec in specs.items():
        folder = tmp_path_factory.mktemp(name)
        merged = make_adapter(tiny_llama_dir, folder, spec)
        made[name] = (folder, greedy_tokens(merged, PROMPT, MAX_TOKENS))
    return made


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(tiny_llama_dir, adapters) -> AsyncIterator[RunningServer]:
    lora = LoRAConfig(
        enabled=True,
        max_loras=2,
        lora_modules=(LoRAModulePath("first", str(adapters["first"][0])),),
    )
    config = dataclasses.replace(tiny_engine_config(tiny_llama_dir), lora=lora)
    running = await start_server(config, frontend=frontend_config("process"))
    yield running
    await running.stop(grace=0)


def _request(lora: str = "", max_tokens: int = MAX_TOKENS) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        token_ids=common_pb2.TokenIds(ids=PROMPT),
        sampling=common_pb2.SamplingParams(temperature=0.0),
        stopping=common_pb2.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True),
        lora=lora,
    )


async def _tokens(generation, lora: str = "") -> list[int]:
    response = await generation.Generate(_request(lora))
    return list(response.token_ids)


async def test_adapters_are_listed_with_their_base_model(admin, adapters, server):
    listed = await admin.ListLoraAdapters(admin_pb2.ListLoraAdaptersRequest())
    assert [(a.name, a.path) for a in listed.adapters] == [("first", str(adapters["first"][0]))]
    models = (await admin.ListModels(admin_pb2.ListModelsRequest())).models
    assert [m.id for m in models] == [models[0].id, "first"]
    assert models[1].parent == models[0].id and models[0].parent == ""
    assert models[1].root == str(adapters["first"][0])


async def test_generation_uses_the_named_adapter(generation, adapters):
    assert await _tokens(generation, "first") == adapters["first"][1]
    assert await _tokens(generation) != adapters["first"][1]  # the base model differs


async def test_tokenization_takes_an_adapters_name_as_model(tokenization, admin):
    """An adapter shares its base model's tokenizer: its name (a model in ListModels) tokenizes
    and detokenizes as the base model does; a name that is neither is NOT_FOUND naming model."""
    chat = common_pb2.Chat(messages=[common_pb2.ChatMessage(role="user", content="Hi")])
    base = (await admin.ListModels(admin_pb2.ListModelsRequest())).models[0].id
    for fields in ({"text": "Hello world"}, {"chat": chat}):
        by_base = await tokenization.Tokenize(
            tokenization_pb2.TokenizeRequest(model=base, **fields)
        )
        by_adapter = await tokenization.Tokenize(
            tokenization_pb2.TokenizeRequest(model="first", **fields)
        )
        assert by_adapter == by_base
    ids = by_base.token_ids
    text = await tokenization.Detokenize(
        tokenization_pb2.DetokenizeRequest(model="first", token_ids=ids)
    )
    assert text == await tokenization.Detokenize(tokenization_pb2.DetokenizeRequest(token_ids=ids))
    for call, request in (
        (tokenization.Tokenize, tokenization_pb2.TokenizeRequest(model="no-such", text="x")),
        (tokenization.Detokenize, tokenization_pb2.DetokenizeRequest(model="no-such")),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            await call(request)
        assert failure.value.code() == grpc.StatusCode.NOT_FOUND
        assert field_violations(failure.value) == ["model"]


async def test_unknown_or_oversized_adapter_names_are_refused(generation):
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await generation.Generate(_request("nobody"))
    assert error.value.code() == grpc.StatusCode.NOT_FOUND
    assert status_detail(error.value, error_details_pb2.ResourceInfo).resource_name == "nobody"
    assert field_violations(error.value) == ["lora"]
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await generation.Generate(_request("x" * 257))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field_violations(error.value) == ["lora"]


async def test_load_and_unload_codes(admin, generation, adapters, tmp_path, tiny_llama_dir):
    folder = str(adapters["second"][0])
    load = admin_pb2.LoadLoraAdapterRequest(lora_name="second", lora_path=folder)
    loaded = await admin.LoadLoraAdapter(load)
    assert (loaded.adapter.name, loaded.adapter.path) == ("second", folder)
    assert await _tokens(generation, "second") == adapters["second"][1]
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await admin.LoadLoraAdapter(load)
    assert error.value.code() == grpc.StatusCode.ALREADY_EXISTS
    big = tmp_path / "r32"
    make_adapter(tiny_llama_dir, big, AdapterSpec(rank=32, alpha=32))
    for path, words in ((tmp_path / "nowhere", "not a loadable"), (big, "--max-lora-rank")):
        request = admin_pb2.LoadLoraAdapterRequest(lora_name="bad", lora_path=str(path))
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await admin.LoadLoraAdapter(request)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field_violations(error.value) == ["lora_path"]
        assert words in error.value.details()
    await admin.UnloadLoraAdapter(admin_pb2.UnloadLoraAdapterRequest(lora_name="second"))
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await admin.UnloadLoraAdapter(admin_pb2.UnloadLoraAdapterRequest(lora_name="second"))
    assert error.value.code() == grpc.StatusCode.NOT_FOUND
    assert field_violations(error.value) == ["lora_name"]
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await generation.Generate(_request("second"))
    assert error.value.code() == grpc.StatusCode.NOT_FOUND


async def _load_error(admin, path) -> grpc.aio.AioRpcError:
    request = admin_pb2.LoadLoraAdapterRequest(lora_name="bad", lora_path=str(path))
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await admin.LoadLoraAdapter(request)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, error.value.details()
    assert field_violations(error.value) == ["lora_path"]
    return error.value


async def test_a_path_that_is_no_adapter_folder_tells_nothing_of_the_filesystem(admin, tmp_path):
    """Missing, a file, a folder without the adapter's files: the same answer, so a caller
    cannot map the server's filesystem."""
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "empty").mkdir()
    (tmp_path / "config-only").mkdir()
    (tmp_path / "config-only" / "adapter_config.json").write_text("{}")
    paths = ["nowhere", "a-file", "empty", "config-only", "nowhere/adapter_config.json"]
    answers = set()
    for name in paths:
        error = await _load_error(admin, tmp_path / name)
        answers.add(error.details().replace(str(tmp_path / name), "PATH"))
    assert answers == {
        "lora_path: 'PATH' is not a loadable LoRA adapter folder (a folder on the server "
        "holding adapter_config.json and adapter_model.safetensors)"
    }


async def test_a_deeply_nested_adapter_config_is_invalid_argument(admin, adapters, tmp_path):
    weights = adapters["second"][0] / "adapter_model.safetensors"
    for name, config in (("deep", "[" * 100_000 + "]" * 100_000), ("big", " " * 2**21 + "{}")):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "adapter_model.safetensors").write_bytes(weights.read_bytes())
        (folder / "adapter_config.json").write_text(config)
        error = await _load_error(admin, folder)
        assert "adapter_config.json" in error.details()


async def test_unloading_under_load_loses_no_request(admin, generation, adapters):
    """Streams of an adapter and of the base model are running when the adapter is unloaded
    and another is loaded: every one finishes with all its tokens."""
    folder = str(adapters["second"][0])
    await admin.LoadLoraAdapter(
        admin_pb2.LoadLoraAdapterRequest(lora_name="busy", lora_path=folder)
    )
    loras = ["busy", "", "first"] * 4
    started = [asyncio.Event() for _ in loras]  # each stream's first tokens came

    async def stream(index: int) -> tuple[list[int], int]:
        tokens, reason = [], 0
        async for response in generation.GenerateStream(_request(loras[index], max_tokens=LONG)):
            tokens += response.token_ids
            reason = response.finish_reason or reason
            started[index].set()
        return tokens, reason

    tasks = [asyncio.ensure_future(stream(index)) for index in range(len(loras))]
    await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), 30)
    await admin.UnloadLoraAdapter(admin_pb2.UnloadLoraAdapterRequest(lora_name="busy"))
    assert not all(task.done() for task in tasks[::3])  # "busy" requests were running
    await admin.LoadLoraAdapter(
        admin_pb2.LoadLoraAdapterRequest(lora_name="late", lora_path=folder)
    )
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await generation.Generate(_request("busy"))
    assert error.value.code() == grpc.StatusCode.NOT_FOUND
    results = await asyncio.wait_for(asyncio.gather(*tasks), 60)
    assert all(len(tokens) == LONG for tokens, _ in results)
    assert {reason for _, reason in results} == {generation_pb2.FINISH_REASON_LENGTH}
    # the unloaded adapter's requests kept its weights: they match the same adapter loaded again
    assert results[0][0][:MAX_TOKENS] == adapters["second"][1]
    assert await _tokens(generation, "late") == adapters["second"][1]
    await admin.UnloadLoraAdapter(admin_pb2.UnloadLoraAdapterRequest(lora_name="late"))


async def test_a_server_without_lora_refuses_the_calls(tiny_llama_dir):
    running = await start_server(
        tiny_engine_config(tiny_llama_dir), frontend=frontend_config("thread")
    )
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            admin = admin_pb2_grpc.AdminServiceStub(channel)
            request = admin_pb2.LoadLoraAdapterRequest(lora_name="a", lora_path="/nowhere")
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await admin.LoadLoraAdapter(request)
            assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "--enable-lora" in error.value.details()
            listed = await admin.ListLoraAdapters(admin_pb2.ListLoraAdaptersRequest())
            assert list(listed.adapters) == []
            generation = generation_pb2_grpc.GenerationServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as error:  # as an unknown model
                await generation.Generate(_request("a"))
            assert error.value.code() == grpc.StatusCode.NOT_FOUND
            assert "--enable-lora" in error.value.details()
    finally:
        await running.stop(grace=0)
