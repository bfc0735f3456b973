"""Fixtures for client tests: one tiny-model server per test module, on a thread of its own,
and ``call``: the same test body run through ``Client`` and ``AsyncClient``."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio
from client_utils import Caller, ServerThread, tiny_engine_config

from llmrpc.clients import AsyncClient, Client


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path) -> Iterator[ServerThread]:
    server = ServerThread(tiny_engine_config(tiny_llama_dir), host="127.0.0.1", port=0)
    yield server
    server.stop()


@pytest_asyncio.fixture(params=["sync", "async"])
async def call(request, server: ServerThread) -> AsyncIterator[Caller]:
    client_class = AsyncClient if request.param == "async" else Client
    caller = Caller(client_class(server.address))
    yield caller
    await caller.close()
