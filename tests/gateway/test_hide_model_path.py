"""``--hide-model-path``: no answer tells a caller where the model or an adapter lies on the
server's filesystem. ``/v1/models`` and gRPC ListModels give each model's served name as its
root (vLLM, and this server by default, give the folder), ListLoraAdapters each adapter's
name as its path, and GetServerInfo's configuration the served name for --model and
--tokenizer and adapter names for --lora-modules."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from envoy_support import Replica, ServerLoop, tiny_engine_config
from gateway_support import RunningGateway, in_process_gateway
from lora_adapters import AdapterSpec, make_adapter

from llmrpc.engine.lora.types import LoRAConfig, LoRAModulePath
from llmrpc.server.settings import FrontendConfig
from llmrpc.v1 import admin_pb2, admin_pb2_grpc


@pytest.fixture(scope="module")
def adapter_dir(tiny_llama_dir, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("sql")
    make_adapter(tiny_llama_dir, folder, AdapterSpec(4, 8, seed=21))
    return folder


@pytest.fixture(scope="module")
def replica(server_loop: ServerLoop, tiny_llama_dir: Path, adapter_dir) -> Iterator[Replica]:
    lora = LoRAConfig(enabled=True, lora_modules=(LoRAModulePath("sql", str(adapter_dir)),))
    config = dataclasses.replace(tiny_engine_config(tiny_llama_dir), lora=lora)
    frontend = FrontendConfig(host="127.0.0.1", grpc_port=0, hide_model_path=True)
    started = server_loop.start_replica(config, frontend=frontend)
    yield started
    started.stop()


@pytest.fixture(scope="module")
def gateway(server_loop: ServerLoop, replica: Replica) -> Iterator[RunningGateway]:
    yield from in_process_gateway(server_loop, replica)


@pytest.fixture(scope="module")
def admin(replica: Replica) -> Iterator[admin_pb2_grpc.AdminServiceStub]:
    with grpc.insecure_channel(replica.address) as channel:
        yield admin_pb2_grpc.AdminServiceStub(channel)


def test_the_model_list_names_no_folder(gateway, admin, tiny_llama_dir, adapter_dir):
    reply = httpx.get(gateway.url + "/v1/models", timeout=30)
    assert reply.status_code == 200
    cards = reply.json()["data"]
    assert [card["root"] for card in cards] == [card["id"] for card in cards]
    assert cards[-1]["id"] == "sql"
    models = admin.ListModels(admin_pb2.ListModelsRequest(), timeout=30).models
    assert [model.root for model in models] == [model.id for model in models]
    adapters = admin.ListLoraAdapters(admin_pb2.ListLoraAdaptersRequest(), timeout=30).adapters
    assert [(adapter.name, adapter.path) for adapter in adapters] == [("sql", "sql")]
    for text in (reply.text, str(models), str(adapters)):
        assert str(tiny_llama_dir) not in text and str(adapter_dir) not in text


def test_the_server_info_names_no_folder(admin, tiny_llama_dir, adapter_dir):
    config = admin.GetServerInfo(admin_pb2.GetServerInfoRequest(), timeout=30).config
    served = config["served_model_name"]
    assert (config["model"], config["lora_modules"]) == (served, "sql")
    assert config["tokenizer"] in ("", served)
    for value in config.values():
        assert str(tiny_llama_dir) not in value and str(adapter_dir) not in value
