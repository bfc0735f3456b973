"""Helpers for server tests: the tiny model's engine configuration, polling, error details."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from llmrpc.engine.config import CacheConfig, EngineConfig, ModelConfig

NUM_KV_BLOCKS = 256


def tiny_engine_config(model_dir: Path, **model_overrides) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model=str(model_dir), dtype="float32", **model_overrides),
        cache=CacheConfig(num_gpu_blocks_override=NUM_KV_BLOCKS),
    )


async def wait_until(condition: Callable[[], bool], timeout: float = 10.0, what: str = "") -> None:
    """Poll ``condition`` every few milliseconds; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what or condition}")
        await asyncio.sleep(0.005)


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


def slow_down(engine, seconds_per_step: float) -> None:
    """Make every engine step take at least ``seconds_per_step``, so requests stay live a while."""
    real_step = engine.core.step

    def slow_step():
        time.sleep(seconds_per_step)
        return real_step()

    engine.core.step = slow_step


def num_live_requests(engine) -> int:
    stats = engine.stats
    return stats.num_running + stats.num_waiting
