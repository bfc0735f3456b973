"""Helpers for client tests: a real server on its own thread, so blocking clients, async clients
and subprocesses can all call it whatever event loop the test runs on."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from llmrpc.clients import AsyncClient, Client, Delta
from llmrpc.engine.config import CacheConfig, EngineConfig, ModelConfig

NUM_KV_BLOCKS = 256


def tiny_engine_config(model_dir: Path) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model=str(model_dir), dtype="float32"),
        cache=CacheConfig(num_gpu_blocks_override=NUM_KV_BLOCKS),
    )


class ServerThread:
    """``start_server`` run on an event loop of its own thread."""

    def __init__(self, engine_config: EngineConfig, **server_kwargs) -> None:
        from llmrpc.server.app import start_server  # tests of the retry logic need no engine

        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="test-server")
        self._thread.start()
        self.running = self.run(start_server(engine_config, **server_kwargs))

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.running.port}"

    def run(self, coroutine, timeout: float = 300.0):
        """Run ``coroutine`` on the server's loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def stop(self) -> None:
        self.run(self.running.stop(grace=0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


class Caller:
    """Calls a ``Client``'s or an ``AsyncClient``'s methods as coroutines, so one test body
    covers both (the blocking client runs on a worker thread)."""

    def __init__(self, client: Client | AsyncClient) -> None:
        self.client = client
        self.is_async = isinstance(client, AsyncClient)

    async def __call__(self, method: str, *args, **kwargs):
        function = getattr(self.client, method)
        if self.is_async:
            return await function(*args, **kwargs)
        return await asyncio.to_thread(function, *args, **kwargs)

    async def collect(self, method: str, *args, **kwargs) -> list[Delta]:
        """Every delta of ``stream`` or ``chat_stream``."""
        function = getattr(self.client, method)
        if self.is_async:
            return [delta async for delta in function(*args, **kwargs)]
        return await asyncio.to_thread(lambda: list(function(*args, **kwargs)))

    async def close(self) -> None:
        if self.is_async:
            await self.client.close()
        else:
            self.client.close()


async def wait_until(condition, timeout: float = 10.0, what: str = "") -> None:
    """Poll ``condition`` every few milliseconds; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what or condition}")
        await asyncio.sleep(0.005)
