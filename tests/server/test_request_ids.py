"""Request ids are 1 to 256 visible ASCII characters, from the request's ``request_id`` field or
the ``x-request-id`` metadata; any other id is INVALID_ARGUMENT naming where it came from, never
INTERNAL, never echoed, never written raw into a log line."""

from __future__ import annotations

import json
import logging

import grpc
import pytest
import pytest_asyncio
from server_utils import bound_server, field_violations, grpcurl

from llmrpc.server.logs import LOG_FORMAT, install_request_id_records, request_id_var
from llmrpc.v1 import admin_pb2, admin_pb2_grpc, generation_pb2, generation_pb2_grpc

pytestmark = pytest.mark.asyncio(loop_scope="module")

BAD_IDS = ["two\nlines", "caf\u00e9", "tab\tbed", "with space", "x" * 257, "y" * 100_000]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server():
    async with bound_server() as running:  # no model: ids are checked before the servicer
        yield running


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def channel(server):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield channel


@pytest.mark.parametrize("bad_id", BAD_IDS, ids=lambda v: repr(v[:12]))
async def test_a_bad_request_id_field_is_invalid_argument_and_not_echoed(channel, bad_id):
    stub = generation_pb2_grpc.GenerationServiceStub(channel)
    call = stub.Generate(generation_pb2.GenerateRequest(text="hi", request_id=bad_id))
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        await call
    assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT, failure.value.details()
    assert field_violations(failure.value) == ["request_id"]
    assert "x-request-id" not in dict(await call.initial_metadata())


@pytest.mark.parametrize("bad_id", ["with space", "z" * 257, "w" * 4000])
async def test_a_bad_x_request_id_is_invalid_argument_naming_the_metadata(channel, bad_id):
    stub = admin_pb2_grpc.AdminServiceStub(channel)
    call = stub.GetServerInfo(
        admin_pb2.GetServerInfoRequest(), metadata=(("x-request-id", bad_id),)
    )
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        await call
    assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field_violations(failure.value) == ["x-request-id"]
    assert "x-request-id" not in dict(await call.initial_metadata())


async def test_the_longest_allowed_id_is_echoed(channel):
    good = "".join(chr(c) for c in range(0x21, 0x7F)) + "k" * (256 - 94)  # every visible char
    stub = admin_pb2_grpc.AdminServiceStub(channel)
    call = stub.GetServerInfo(admin_pb2.GetServerInfoRequest(), metadata=(("x-request-id", good),))
    await call
    assert dict(await call.initial_metadata())["x-request-id"] == good


async def test_grpcurl_user_sending_a_newline_in_request_id_gets_invalid_argument(server):
    body = json.dumps({"text": "hi", "request_id": "a\nb"})
    address = f"127.0.0.1:{server.port}"
    method = "llmrpc.v1.GenerationService/Generate"
    rc, _, err = await grpcurl("-plaintext", "-d", body, address, method)
    assert rc != 0
    assert "InvalidArgument" in err and "request_id" in err, err


async def test_log_lines_escape_the_request_id(caplog):
    """Defence in depth: even an id that got past the checks cannot forge a log line."""
    install_request_id_records()
    forged = "r1\n2026-01-01 00:00:00.000 INFO llmrpc.server.admin: prefix cache reset\x1b[2J"
    token = request_id_var.set(forged)
    try:
        with caplog.at_level(logging.INFO, logger="test.ids"):
            logging.getLogger("test.ids").info("hello")
    finally:
        request_id_var.reset(token)
    line = logging.Formatter(LOG_FORMAT).format(caplog.records[-1])
    assert "\n" not in line and "\x1b" not in line
    assert "[r1\\n2026-01-01" in line and "\\x1b[2J]" in line


async def test_abort_takes_at_most_1024_ids(channel):
    stub = admin_pb2_grpc.AdminServiceStub(channel)
    ids = [f"id-{n}" for n in range(1025)]
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        await stub.Abort(admin_pb2.AbortRequest(request_ids=ids))
    assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field_violations(failure.value) == ["request_ids"]
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        await stub.Abort(admin_pb2.AbortRequest(request_ids=ids[:1024]))
    assert failure.value.code() == grpc.StatusCode.UNAVAILABLE  # in bounds; no model loaded
