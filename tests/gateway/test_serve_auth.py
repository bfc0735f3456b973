"""Keys and request ids over REST as ``llmrpc serve`` runs it (the gateway calling its server
through the in-process channel), against gRPC on the same server: one bearer rule on both; the
REST caller's own key is the one the server authorizes; a bad X-Request-Id is a 400 naming it;
the transcoded admin routes (Envoy) follow the gRPC rule."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import grpc
import httpx
import pytest
from engine_pace import num_live_requests, restore_speed, slow_down
from envoy_support import envoy_config, running_envoy, tiny_engine_config, wait_for
from gateway_support import RunningGateway, wait_serving

from llmrpc.cli.rest import IN_PROCESS_TARGET, gateway_settings
from llmrpc.gateway.envoy import GRPC_CLUSTER
from llmrpc.gateway.settings import HttpSettings
from llmrpc.server.app import start_server
from llmrpc.server.settings import FrontendConfig
from llmrpc.v1 import admin_pb2, admin_pb2_grpc

ALICE, BOB, ADMIN = "alice-key-0001", "bob-key-0002", "admin-key-0003"


@pytest.fixture(scope="module")
def served(server_loop, tiny_llama_dir) -> Iterator[tuple]:
    """(running gRPC server, its REST gateway), wired as ``llmrpc serve`` wires them."""
    frontend = FrontendConfig(
        host="127.0.0.1", grpc_port=0, api_key=(ALICE, BOB), admin_api_key=(ADMIN,),
        rest_http=HttpSettings(port=0, uvicorn_log_level="warning"),
    )  # fmt: skip
    running = server_loop.run(start_server(tiny_engine_config(tiny_llama_dir), frontend=frontend))
    settings = gateway_settings(frontend)
    gateway = RunningGateway(server_loop, settings, {IN_PROCESS_TARGET: running.loopback})
    try:
        wait_serving(gateway)
        yield running, gateway
    finally:
        gateway.stop()
        server_loop.run(running.stop(grace=0))


@pytest.fixture(scope="module")
def admin_stub(served) -> Iterator[admin_pb2_grpc.AdminServiceStub]:
    with grpc.insecure_channel(f"127.0.0.1:{served[0].port}") as channel:
        yield admin_pb2_grpc.AdminServiceStub(channel)


def auth(value: str) -> dict[str, str]:
    return {"authorization": value}


# Authorization values and whether they present ALICE's key: one rule, RFC 7235's, on both.
# (Spaces around a whole value are ignored too, but HTTP clients strip them before sending.)
CREDENTIALS = [
    (f"Bearer {ALICE}", True),
    (f"bearer {ALICE}", True),
    (f"BEARER    {ALICE}", True),
    (f"Bearer{ALICE}", False),
    (ALICE, False),
    (f"Basic {ALICE}", False),
    (f"Bearer {ALICE} x", False),
    ("Bearer", False),
]


@pytest.mark.parametrize(("value", "accepted"), CREDENTIALS)
def test_grpc_and_rest_accept_the_same_authorization_values(served, admin_stub, value, accepted):
    _, gateway = served
    rest = httpx.get(gateway.url + "/v1/models", headers=auth(value), timeout=30)
    assert rest.status_code == (200 if accepted else 401), rest.text
    try:
        admin_stub.ListModels(admin_pb2.ListModelsRequest(), metadata=(("authorization", value),))
        grpc_accepted = True
    except grpc.RpcError as error:
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED
        grpc_accepted = False
    assert grpc_accepted == accepted


def test_a_tab_is_no_separator_on_rest_either(served):
    _, gateway = served
    refused = httpx.get(gateway.url + "/v1/models", headers=auth(f"Bearer\t{ALICE}"), timeout=30)
    assert refused.status_code == 401


def test_the_admin_key_also_generates_over_rest(served):
    _, gateway = served
    models = httpx.get(gateway.url + "/v1/models", headers=auth(f"Bearer {ADMIN}"), timeout=30)
    assert models.status_code == 200, models.text


@pytest.mark.parametrize(
    "bad_id", [b"with space", b"caf\xc3\xa9", b"x" * 129, b"y" * 10_000], ids=lambda v: v[:8]
)
def test_a_bad_x_request_id_is_a_400_naming_the_header(served, bad_id):
    _, gateway = served
    headers = {**auth(f"Bearer {ALICE}"), "x-request-id": bad_id}
    body = {"prompt": "hi", "max_tokens": 1}
    response = httpx.post(gateway.url + "/v1/completions", json=body, headers=headers, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "x-request-id" and error["type"] == "invalid_request_error"
    assert "x-request-id" not in response.headers


def test_the_rest_callers_own_key_is_what_the_server_authorizes(served, admin_stub):
    """Bob's REST request is Bob's: Alice cannot abort it, Bob can."""
    running, gateway = served
    slow_down(running.engine, 0.02)
    body = {"prompt": "The fox", "max_tokens": 200, "ignore_eos": True, "stream": True}
    headers = {**auth(f"Bearer {BOB}"), "x-request-id": "rest-bob-1"}
    try:
        with httpx.stream(
            "POST", gateway.url + "/v1/completions", json=body, headers=headers, timeout=60
        ) as response:
            assert response.status_code == 200
            lines = response.iter_lines()  # kept: a dropped iterator closes the response
            next(lines)  # the request is live

            def abort(key: str) -> list[str]:
                request = admin_pb2.AbortRequest(request_ids=["rest-bob-1"])
                reply = admin_stub.Abort(request, metadata=(("authorization", f"Bearer {key}"),))
                return list(reply.aborted_request_ids)

            assert abort(ALICE) == []
            assert abort(BOB) == ["rest-bob-1"]
    finally:
        restore_speed(running.engine)
    wait_for(lambda: num_live_requests(running.engine) == 0, "the abort")


def test_envoys_transcoded_admin_routes_follow_the_grpc_rule(served, tmp_path):
    """No admin route of the gateway's own: Envoy's transcoder calls AdminService over gRPC,
    where the interceptor decides, so /v1/admin/* gets the same answers."""
    running, _ = served
    address = f"127.0.0.1:{running.port}"
    args = ["--listen", "127.0.0.1:0", "--admin-port", "0", "--backend", address]
    args += ["--health-check-interval", "0.2", "--unhealthy-threshold", "1"]
    with running_envoy(envoy_config(tmp_path, *args)) as envoy:
        wait_for(lambda: "healthy" in envoy.host_health(GRPC_CLUSTER).values(), "a healthy replica")
        url = f"http://{envoy.address}/v1/admin/reset_prefix_cache"

        def post(key: str | None) -> int:
            headers = auth(f"Bearer {key}") if key else {}
            return httpx.post(url, json={}, headers=headers, timeout=30).status_code

        assert post(BOB) == 403
        assert post(None) == 401
        assert post(ADMIN) == 200
        load = httpx.get(f"http://{envoy.address}/v1/admin/load", headers=auth(f"Bearer {BOB}"))
        assert load.status_code == 200


def test_serve_settings_give_rest_the_admin_keys_too():
    frontend = FrontendConfig(api_key=("k",), admin_api_key=("a",))
    assert set(gateway_settings(frontend).api.api_keys) == {"k", "a"}
    open_generation = dataclasses.replace(frontend, api_key=())
    assert gateway_settings(open_generation).api.api_keys == ()  # REST generation stays open
