"""LoRA through the REST gateway: the OpenAI SDK with ``model`` naming an adapter, adapters in
``/v1/models`` (vLLM's shape: id, root, parent), and vLLM's load/unload routes."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from envoy_support import Replica, ServerLoop, tiny_engine_config
from gateway_support import RunningGateway, in_process_gateway
from lora_adapters import AdapterSpec, greedy_tokens, make_adapter

from llmrpc.clients import LlmrpcError
from llmrpc.engine.lora.types import LoRAConfig, LoRAModulePath

PROMPT = [1, 504, 3458, 314, 260, 3575, 282]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory):
    """name -> (folder, the text of PEFT's merged model's greedy tokens for PROMPT)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    made = {}
    for name, spec in {
        "sql": AdapterSpec(8, 16, seed=21),
        "poem": AdapterSpec(4, 8, seed=22),
    }.items():
        folder = tmp_path_factory.mktemp(name)
        merged = make_adapter(tiny_llama_dir, folder, spec)
        made[name] = (folder, tokenizer.decode(greedy_tokens(merged, PROMPT, MAX_TOKENS)))
    return made


@pytest.fixture(scope="module")
def replica(server_loop: ServerLoop, tiny_llama_dir: Path, adapters) -> Iterator[Replica]:
    lora = LoRAConfig(
        enabled=True, max_loras=2, lora_modules=(LoRAModulePath("sql", str(adapters["sql"][0])),)
    )
    config = dataclasses.replace(tiny_engine_config(tiny_llama_dir), lora=lora)
    started = server_loop.start_replica(config, port=0)
    yield started
    started.stop()


@pytest.fixture(scope="module")
def gateway(server_loop: ServerLoop, replica: Replica) -> Iterator[RunningGateway]:
    yield from in_process_gateway(server_loop, replica)


def _complete(sdk: openai.OpenAI, model: str) -> str:
    reply = sdk.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    assert reply.model == model
    return reply.choices[0].text


def test_models_list_the_adapters_with_their_parent(sdk, adapters):
    models = [model.model_dump() for model in sdk.models.list().data]
    base, adapter = models[0], models[1]
    assert base["parent"] is None
    assert (adapter["id"], adapter["parent"]) == ("sql", base["id"])
    assert adapter["root"] == str(adapters["sql"][0])


def test_model_naming_an_adapter_generates_with_it(sdk, adapters):
    assert _complete(sdk, "sql") == adapters["sql"][1]
    base = sdk.models.list().data[0].id
    assert _complete(sdk, base) != adapters["sql"][1]
    chat = sdk.chat.completions.create(
        model="sql", messages=[{"role": "user", "content": "Hi"}], max_tokens=3
    )
    assert chat.model == "sql" and chat.choices[0].message.content is not None


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "x"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
        ("/tokenize", {"prompt": "x"}),
    ],
)
def test_an_unknown_model_is_404_naming_the_models_and_adapters(gateway, path, body):
    reply = httpx.post(gateway.url + path, json={**body, "model": "no-such"}, timeout=60)
    assert reply.status_code == 404, reply.text
    error = reply.json()["error"]
    assert error["param"] == "model" and error["code"] == "model_not_found", error
    assert error["message"].startswith("The model `no-such` does not exist"), error
    assert "LoRA adapters: `sql`" in error["message"] and "--enable-lora" not in error["message"]


def test_grpc_model_naming_an_adapter_generates_with_it(grpc_client, adapters):
    kwargs = {"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}
    by_model = grpc_client.generate(PROMPT, model="sql", **kwargs)
    assert by_model.text == adapters["sql"][1]
    with pytest.raises(LlmrpcError) as caught:
        grpc_client.generate(PROMPT, model="no-such", max_tokens=MAX_TOKENS)
    assert caught.value.code == grpc.StatusCode.NOT_FOUND
    assert [violation.field for violation in caught.value.field_violations] == ["model"]


def test_load_and_unload_routes(sdk, gateway, adapters, tmp_path):
    folder = str(adapters["poem"][0])
    with httpx.Client(base_url=gateway.url, timeout=30) as http:
        loaded = http.post("/v1/load_lora_adapter", json={"lora_name": "poem", "lora_path": folder})
        assert loaded.status_code == 200, loaded.text
        assert loaded.text == "Success: LoRA adapter 'poem' added successfully."
        assert _complete(sdk, "poem") == adapters["poem"][1]
        assert "poem" in {model.id for model in sdk.models.list().data}
        again = http.post("/v1/load_lora_adapter", json={"lora_name": "poem", "lora_path": folder})
        assert again.status_code == 400  # vLLM's status for a name already loaded
        error = again.json()["error"]
        assert (error["type"], error["param"], error["code"]) == (
            "invalid_request_error",
            "lora_name",
            "already_exists",
        )
        assert error["message"].startswith("lora_name: ")
        missing = str(tmp_path / "nowhere")
        bad = http.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": missing})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path"
        unloaded = http.post("/v1/unload_lora_adapter", json={"lora_name": "poem"})
        assert unloaded.status_code == 200, unloaded.text
        assert unloaded.text == "Success: LoRA adapter 'poem' removed successfully."
        gone = http.post("/v1/unload_lora_adapter", json={"lora_name": "poem"})
        assert gone.status_code == 404 and gone.json()["error"]["param"] == "lora_name"
    with pytest.raises(openai.NotFoundError):
        _complete(sdk, "poem")


def test_unload_goes_by_name_whatever_lora_int_id_says(sdk, gateway, adapters):
    """vLLM's unload body may carry lora_int_id; vLLM unloads by lora_name, and so does this
    route. The id must still be a 32-bit integer: anything else is a 400 naming it."""
    with httpx.Client(base_url=gateway.url, timeout=30) as http:
        for bad in ("seven", 2**31, -(2**31) - 1, 1.5):
            body = {"lora_name": "sql", "lora_int_id": bad}
            refused = http.post("/v1/unload_lora_adapter", json=body)
            assert refused.status_code == 400, (bad, refused.text)
            assert refused.json()["error"]["param"] == "lora_int_id"
        assert "sql" in {model.id for model in sdk.models.list().data}  # nothing unloaded
        body = {"lora_name": "twin", "lora_path": str(adapters["poem"][0])}
        assert http.post("/v1/load_lora_adapter", json=body).status_code == 200
        body = {"lora_name": "twin", "lora_int_id": 987654}
        unloaded = http.post("/v1/unload_lora_adapter", json=body)
        assert unloaded.status_code == 200, unloaded.text
    assert "twin" not in {model.id for model in sdk.models.list().data}


def test_the_lora_routes_document_their_error_statuses(gateway):
    paths = httpx.get(gateway.url + "/openapi.json", timeout=10).json()["paths"]
    for route, statuses in {
        "/v1/load_lora_adapter": {"200", "400", "4XX", "5XX"},
        "/v1/unload_lora_adapter": {"200", "400", "404", "4XX", "5XX"},
    }.items():
        responses = paths[route]["post"]["responses"]
        assert set(responses) == statuses, route
        assert "409" not in responses


def test_tokenize_and_detokenize_take_an_adapters_name(gateway):
    with httpx.Client(base_url=gateway.url, timeout=30) as http:
        base = http.post("/tokenize", json={"prompt": "Hello world"}).json()
        adapter = http.post("/tokenize", json={"model": "sql", "prompt": "Hello world"})
        assert adapter.status_code == 200, adapter.text
        assert adapter.json() == base
        body = {"model": "sql", "tokens": base["tokens"]}
        text = http.post("/detokenize", json=body)
        assert (text.status_code, text.json()) == (200, {"prompt": "Hello world"})
        unknown = http.post("/tokenize", json={"model": "no-such", "prompt": "x"})
        assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"


def test_python_client_lists_adapters_and_generates_with_one(grpc_client, adapters):
    listed = grpc_client.lora_adapters()
    assert [(a.name, a.path) for a in listed] == [("sql", str(adapters["sql"][0]))]
    cards = grpc_client.models()
    assert (cards[1].id, cards[1].parent) == ("sql", cards[0].id)
    completion = grpc_client.generate(
        PROMPT, lora="sql", max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True
    )
    assert completion.text == adapters["sql"][1]
