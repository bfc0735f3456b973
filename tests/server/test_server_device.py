"""GetServerInfo's device is where the model's weights are, read from the model itself."""

from __future__ import annotations

import pytest
import torch

from llmrpc.v1 import admin_pb2

pytestmark = pytest.mark.asyncio(loop_scope="module")


def weights_device(server) -> str:
    return str(next(server.engine.core.runner.model.parameters()).device)


async def test_device_is_the_device_of_the_weights(admin, server):
    info = await admin.GetServerInfo(admin_pb2.GetServerInfoRequest())
    assert info.capabilities.device == weights_device(server) == "cpu"


async def test_device_follows_the_weights_wherever_they_are(admin, server):
    """Weights elsewhere (a model on the meta device: no storage, no GPU needed) are reported
    there: the answer is read from the model, not assumed. (A stand-in model: the loaded one's
    linear layers are packed for oneDNN, which has no meta form.)"""
    runner = server.engine.core.runner
    loaded = runner.model
    runner.model = torch.nn.Linear(4, 4, device="meta")  # the engine is idle: no step reads it
    try:
        info = await admin.GetServerInfo(admin_pb2.GetServerInfoRequest())
        assert info.capabilities.device == weights_device(server) == "meta"
    finally:
        runner.model = loaded
