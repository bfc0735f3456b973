"""--api-key: every call but health and reflection needs ``authorization: Bearer <key>``;
UNAUTHENTICATED otherwise. Through the Python stubs and grpcurl -H."""

from __future__ import annotations

import json
import logging

import grpc
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2
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


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
async def test_reflection_needs_no_key_in_either_version(channel, version):
    call = channel.stream_stream(
        f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
        request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
        response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
    )
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    (response,) = [reply async for reply in call(iter([request]))]
    names = [service.name for service in response.list_services_response.service]
    assert f"grpc.reflection.{version}.ServerReflection" in names


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


# --- RFC 7235 credentials -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [f"BEARER {KEYS[0]}", f"Bearer   {KEYS[0]}", f"  bearer {KEYS[1]}  ", f"bEaReR {KEYS[1]}"],
)
async def test_the_scheme_is_case_insensitive_and_spaces_separate_it_from_the_key(channel, value):
    admin = admin_pb2_grpc.AdminServiceStub(channel)
    await admin.GetServerInfo(admin_pb2.GetServerInfoRequest(), metadata=bearer(value))


@pytest.mark.parametrize("value", [f"Bearer{KEYS[0]}", f"Bearer {KEYS[0]} extra", "Bearer  "])
async def test_no_other_separator_or_trailing_text_passes(channel, value):
    admin = admin_pb2_grpc.AdminServiceStub(channel)
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        await admin.GetServerInfo(admin_pb2.GetServerInfoRequest(), metadata=bearer(value))
    assert failure.value.code() == grpc.StatusCode.UNAUTHENTICATED


# --- --admin-api-key: generation keys generate, the admin key administers ---------------------

ADMIN_KEY = "admin-key-89ab"
# Every AdminService RPC, by whether a generation key may call it. A new RPC must be put in one.
READ_ONLY = {
    "GetServerInfo",
    "GetModelInfo",
    "ListModels",
    "GetLoad",
    "IsSleeping",
    "Abort",
    "ListLoraAdapters",
}
STATE_CHANGING = {"ResetPrefixCache", "Sleep", "WakeUp", "LoadLoraAdapter", "UnloadLoraAdapter"}
ADMIN_METHODS = admin_pb2.DESCRIPTOR.services_by_name["AdminService"].methods


async def test_every_admin_rpc_is_classified():
    assert {m.name for m in ADMIN_METHODS} == READ_ONLY | STATE_CHANGING


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def with_admin():
    async with (
        bound_server(api_key=KEYS, admin_api_key=(ADMIN_KEY,)) as running,
        grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel,
    ):
        yield running, channel


async def admin_call(channel, name: str, key: str | None) -> grpc.StatusCode:
    """The status of AdminService/``name`` called with ``key`` (no model loaded: a call that
    passes the key check ends UNAVAILABLE, or OK for the server's own facts)."""
    method = ADMIN_METHODS[[m.name for m in ADMIN_METHODS].index(name)]
    request_class = getattr(admin_pb2, method.input_type.name)
    response_class = getattr(admin_pb2, method.output_type.name)
    call = channel.unary_unary(
        f"/llmrpc.v1.AdminService/{name}",
        request_serializer=request_class.SerializeToString,
        response_deserializer=response_class.FromString,
    )
    metadata = bearer(f"Bearer {key}") if key else ()
    try:
        await call(request_class(), metadata=metadata)
    except grpc.aio.AioRpcError as error:
        return error.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize("name", sorted(STATE_CHANGING))
async def test_state_changing_admin_rpcs_refuse_generation_keys(with_admin, name):
    _, channel = with_admin
    assert await admin_call(channel, name, KEYS[0]) == grpc.StatusCode.PERMISSION_DENIED
    assert await admin_call(channel, name, None) == grpc.StatusCode.UNAUTHENTICATED
    assert await admin_call(channel, name, "wrong") == grpc.StatusCode.UNAUTHENTICATED
    assert await admin_call(channel, name, ADMIN_KEY) == grpc.StatusCode.UNAVAILABLE  # passed


@pytest.mark.parametrize("name", sorted(READ_ONLY))
async def test_read_only_admin_rpcs_stay_open_to_generation_keys(with_admin, name):
    _, channel = with_admin
    for key in (KEYS[1], ADMIN_KEY):
        code = await admin_call(channel, name, key)
        assert code in (grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE), (key, code)
    assert await admin_call(channel, name, None) == grpc.StatusCode.UNAUTHENTICATED


async def test_server_info_says_which_calls_need_which_key(with_admin, channel):
    _, admin_channel = with_admin
    stub = admin_pb2_grpc.AdminServiceStub(admin_channel)
    info = await stub.GetServerInfo(
        admin_pb2.GetServerInfoRequest(), metadata=bearer(f"Bearer {KEYS[0]}")
    )
    assert info.capabilities.auth_required and info.capabilities.admin_auth_required
    assert ADMIN_KEY not in str(info)
    plain = admin_pb2_grpc.AdminServiceStub(channel)  # --api-key alone
    info = await plain.GetServerInfo(
        admin_pb2.GetServerInfoRequest(), metadata=bearer(f"Bearer {KEYS[0]}")
    )
    assert info.capabilities.auth_required and not info.capabilities.admin_auth_required


async def test_the_admin_key_also_generates(with_admin):
    _, channel = with_admin
    generation = generation_pb2_grpc.GenerationServiceStub(channel)
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        await generation.Generate(
            generation_pb2.GenerateRequest(text="hi"), metadata=bearer(f"Bearer {ADMIN_KEY}")
        )
    assert failure.value.code() == grpc.StatusCode.UNAVAILABLE  # past the key: no model loaded


async def test_grpcurl_with_a_generation_key_is_permission_denied_on_sleep(with_admin):
    running, _ = with_admin
    address = f"127.0.0.1:{running.port}"
    method = "llmrpc.v1.AdminService/Sleep"
    header = f"authorization: Bearer {KEYS[0]}"
    rc, _, err = await grpcurl("-plaintext", "-H", header, address, method)
    assert rc != 0 and "PermissionDenied" in err, err
    assert "admin" in err


async def test_an_admin_key_alone_leaves_generation_open_and_guards_admin_rpcs():
    async with (
        bound_server(admin_api_key=(ADMIN_KEY,)) as running,
        grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel,
    ):
        assert await admin_call(channel, "GetServerInfo", None) == grpc.StatusCode.OK
        assert await admin_call(channel, "Sleep", None) == grpc.StatusCode.UNAUTHENTICATED
        assert await admin_call(channel, "Sleep", "wrong") == grpc.StatusCode.UNAUTHENTICATED
        assert await admin_call(channel, "Sleep", ADMIN_KEY) == grpc.StatusCode.UNAVAILABLE


async def test_admin_api_key_flag_and_environment(monkeypatch):
    from llmrpc import cli
    from llmrpc.server import options

    parser = cli.build_parser()[1]

    def frontend(*argv: str):
        return options.build_configs(options.parse_serve_values(parser, ["m", *argv]))[1]

    assert frontend("--admin-api-key", "a1", "a2").admin_api_key == ("a1", "a2")
    monkeypatch.setenv("LLMRPC_ADMIN_API_KEY", "from-env")
    assert frontend().admin_api_key == ("from-env",)
    with pytest.raises(ValueError, match="--admin-api-key"):
        frontend("--api-key", "same", "--admin-api-key", "same")
    assert "admin_api_key" not in options.effective_config(*options.build_configs(
        options.parse_serve_values(parser, ["m", "--admin-api-key", "secret"])
    ))  # fmt: skip
