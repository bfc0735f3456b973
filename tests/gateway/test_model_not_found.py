"""A ``model`` that names nothing served is "model not found", on every route that takes one:
OpenAI's ``model_not_found`` 404 on REST, NOT_FOUND naming ``model`` on gRPC, each naming the
served models, never blamed on LoRA (this replica runs without --enable-lora)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import grpc
import openai
import pytest
from envoy_support import Replica, ServerLoop, tiny_engine_config
from gateway_support import post

from llmrpc.clients import Client, LlmrpcError

SERVED = "tiny-chat"  # --served-model-name
MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def replica(server_loop: ServerLoop, tiny_llama_dir: Path) -> Iterator[Replica]:
    config = tiny_engine_config(tiny_llama_dir)
    model = dataclasses.replace(config.model, served_model_name=(SERVED,))
    started = server_loop.start_replica(dataclasses.replace(config, model=model), port=0)
    yield started
    started.stop()


def _bodies(model: str) -> list[tuple[str, dict]]:
    return [
        ("/v1/chat/completions", {"model": model, "messages": MESSAGES, "max_tokens": 2}),
        ("/v1/chat/completions", {"model": model, "messages": MESSAGES, "stream": True}),
        ("/v1/completions", {"model": model, "prompt": "x", "max_tokens": 2}),
        ("/v1/completions", {"model": model, "prompt": "x", "stream": True}),
        ("/v1/responses", {"model": model, "input": "Hi", "max_output_tokens": 2}),
        ("/v1/embeddings", {"model": model, "input": "x"}),
        ("/tokenize", {"model": model, "prompt": "x"}),
        ("/detokenize", {"model": model, "tokens": [1, 2]}),
    ]


@pytest.mark.parametrize("index", range(len(_bodies(""))))
@pytest.mark.parametrize("model", ["gpt-4", "default-name"])
def test_rest_says_the_model_does_not_exist_and_names_the_served_one(
    gateway, tiny_llama_dir, model, index
):
    # "default-name": the name the model would have without --served-model-name
    model = str(tiny_llama_dir) if model == "default-name" else model
    path, body = _bodies(model)[index]
    reply = post(gateway, path, body)
    assert reply.status_code == 404, (path, reply.text)
    error = reply.json()["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model", error
    assert error["type"] == "not_found_error", error
    assert error["message"].startswith(f"The model `{model}` does not exist"), error
    assert f"`{SERVED}`" in error["message"] and "LoRA" not in error["message"], error


def test_the_sdk_raises_not_found_naming_the_served_model(gateway):
    sdk = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as caught:
        sdk.chat.completions.create(model="gpt-4", messages=MESSAGES, max_tokens=2)
    assert caught.value.code == "model_not_found" and caught.value.param == "model"
    assert SERVED in caught.value.message


@pytest.mark.parametrize("call", ["generate", "tokenize", "embed"])
def test_grpc_is_not_found_naming_the_model_field_and_the_served_one(replica, call):
    with Client(replica.address) as client, pytest.raises(LlmrpcError) as caught:
        if call == "generate":
            client.generate("x", model="gpt-4", max_tokens=2)
        elif call == "tokenize":
            client.tokenize("x", model="gpt-4")
        else:
            client.embed(["x"], model="gpt-4")
    error = caught.value
    assert error.code == grpc.StatusCode.NOT_FOUND, error
    assert [violation.field for violation in error.field_violations] == ["model"], error
    assert error.details.resource.resource_type == "model", error
    assert error.details.resource.resource_name == "gpt-4", error
    assert f"`{SERVED}`" in error.message and "LoRA" not in error.message, error
