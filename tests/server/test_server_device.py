"""GetServerInfo's device is where the model's weights are, read from the model itself."""

from __future__ import annotations

import copy

import pytest

from llmrpc.v1 import admin_pb2

pytestmark = pytest.mark.asyncio(loop_scope="module")


def weights_device(server) -> str:
    return str(next(server.engine.core.runner.model.parameters()).device)


async def test_device_is_the_device_of_the_weights(admin, server):
    info = await admin.GetServerInfo(admin_pb2.GetServerInfoRequest())
    assert info.capabilities.device == weights_device(server) == "cpu"


async def test_device_follows_the_weights_wherever_they_are(admin, server):
    """Weights moved elsewhere (the meta device: no storage, no GPU needed) are reported there:
    the answer is read from the model, not assumed."""
    runner = server.engine.core.runner
    loaded = runner.model
    runner.model = copy.deepcopy(loaded).to("meta")  # the engine is idle: no step reads it
    try:
        info = await admin.GetServerInfo(admin_pb2.GetServerInfoRequest())
        assert info.capabilities.device == weights_device(server) == "meta"
    finally:
        runner.model = loaded
