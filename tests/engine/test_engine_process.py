"""The engine core in a process of its own: its death fails everything waiting on it with the
cause; it never outlives the frontend's process; it stops cleanly; its log records reach the
frontend's logging; a service manager's SIGTERM or a terminal's SIGINT to the process group do
not kill it (the frontend drains, then stops it)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import engine_hooks
import pytest
from engine_plugin import call_in_core
from process_state import process_ended

from llmrpc.engine.client.async_engine import EngineDeadError
from llmrpc.engine.client.process import EngineProcessClient
from llmrpc.engine.config import CacheConfig, EngineConfig, ModelConfig
from llmrpc.engine.request import SamplingParams

LONG = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)


def engine_config(model_dir) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model=str(model_dir), dtype="float32", max_model_len=512),
        cache=CacheConfig(num_gpu_blocks_override=64),
    )


async def wait_until_ended(pid: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not process_ended(pid):
        if time.monotonic() > deadline:
            pytest.fail(f"process {pid} still runs after {timeout} s")
        await asyncio.sleep(0.05)


async def test_a_killed_engine_process_fails_every_request_with_the_cause(
    tiny_llama_dir, tiny_llama_tokenizer, caplog
):
    engine = await EngineProcessClient.create(engine_config(tiny_llama_dir))
    try:
        causes = []
        engine.on_dead.append(causes.append)
        prompt = tiny_llama_tokenizer.encode("Hello there")
        outputs = aiter(engine.generate("victim", prompt, LONG))
        await anext(outputs)
        os.kill(engine.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match=f"pid {engine.pid}.* killed by SIGKILL"):
            async for _ in outputs:
                pass
        assert [str(cause) for cause in causes] == [
            f"the engine process (pid {engine.pid}) was killed by SIGKILL"
        ]
        assert not engine.is_running
        with pytest.raises(EngineDeadError, match="SIGKILL"):
            await anext(aiter(engine.generate("after", prompt, LONG)))
        with pytest.raises(EngineDeadError, match="SIGKILL"):
            await engine.abort(["victim"])
    finally:
        await engine.shutdown()


async def test_a_result_that_cannot_cross_is_a_type_error_and_the_engine_goes_on(tiny_llama_dir):
    engine = await EngineProcessClient.create(engine_config(tiny_llama_dir))
    try:
        with pytest.raises(TypeError, match="the result cannot be sent back"):
            await call_in_core(engine, engine_hooks.the_runner)
        assert await call_in_core(engine, engine_hooks.weights_device) == "cpu"
        assert engine.is_running
    finally:
        await engine.shutdown()


async def test_sigterm_and_sigint_do_not_stop_the_engine_process_but_shutdown_does(
    tiny_llama_dir, tiny_llama_tokenizer, caplog
):
    caplog.set_level(logging.INFO)
    engine = await EngineProcessClient.create(engine_config(tiny_llama_dir))
    pid, folder = engine.pid, engine._folder
    # The engine process's log records are this process's, under their own logger names.
    assert any(
        r.name == "llmrpc.engine.core.engine_core"
        and r.getMessage().startswith("KV cache: 64 blocks")
        and r.process == pid
        for r in caplog.records
    )
    prompt = tiny_llama_tokenizer.encode("Still here")
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for signum in (signal.SIGTERM, signal.SIGINT):
        os.kill(pid, signum)
    await asyncio.sleep(0.5)
    outputs = [o async for o in engine.generate("r", prompt, params)]
    assert outputs[-1].num_output_tokens == 4 and engine.is_running
    first_output = asyncio.Event()
    waiting = asyncio.ensure_future(_consume(engine, prompt, first_output))
    await asyncio.wait_for(first_output.wait(), 30)  # a request in flight
    await engine.shutdown()
    assert engine._returncode == 0 and not engine.is_running
    assert process_ended(pid) and not os.path.exists(folder)
    with pytest.raises(EngineDeadError, match="shut down"):
        await waiting  # what still waited on it is told, not left hanging


async def _consume(engine, prompt, first_output: asyncio.Event) -> None:
    async for _ in engine.generate("unfinished", prompt, LONG):
        first_output.set()


async def test_the_engine_process_exits_when_the_frontend_process_dies(tiny_llama_dir):
    """However the frontend ends (here: SIGKILL, no clean-up at all), its engine process ends
    too: no orphan keeps the model's memory."""
    script = textwrap.dedent(
        f"""
        import asyncio, sys
        from llmrpc.engine.config import CacheConfig, EngineConfig, ModelConfig
        from llmrpc.engine.client.process import EngineProcessClient

        async def main():
            config = EngineConfig(
                model=ModelConfig(model={str(tiny_llama_dir)!r}, dtype="float32"),
                cache=CacheConfig(num_gpu_blocks_override=64),
            )
            engine = await EngineProcessClient.create(config)
            print(engine.pid, flush=True)
            await asyncio.sleep(3600)

        asyncio.run(main())
        """
    )
    frontend = await asyncio.create_subprocess_exec(
        sys.executable, "-c", script, stdout=subprocess.PIPE
    )
    try:
        line = await asyncio.wait_for(frontend.stdout.readline(), 120)
        engine_pid = int(line)
        assert not process_ended(engine_pid)
    finally:
        frontend.kill()
        await frontend.wait()
    await wait_until_ended(engine_pid)


async def test_the_engine_process_exits_when_the_frontend_dies_while_it_loads(tiny_llama_dir):
    script = textwrap.dedent(
        f"""
        import asyncio, logging
        from llmrpc.engine.config import CacheConfig, EngineConfig, ModelConfig
        from llmrpc.engine.client.process import EngineProcessClient

        logging.basicConfig(level=logging.INFO)
        config = EngineConfig(
            model=ModelConfig(model={str(tiny_llama_dir)!r}, dtype="float32"),
            cache=CacheConfig(num_gpu_blocks_override=64),
        )
        asyncio.run(EngineProcessClient.create(config))
        """
    )
    frontend = await asyncio.create_subprocess_exec(
        sys.executable, "-c", script, stderr=subprocess.PIPE
    )
    try:
        while b"engine process started" not in (line := await frontend.stderr.readline()):
            assert line, "the frontend ended before it started its engine process"
        engine_pid = int(line.split(b"(pid ")[1].split(b")")[0])
    finally:
        frontend.kill()  # while its engine process imports and loads
        await frontend.wait()
    await wait_until_ended(engine_pid)


async def test_a_death_while_loading_is_reported_as_such(tiny_llama_dir, monkeypatch):
    """An engine process killed before its model is loaded: create() raises EngineDeadError
    with the cause, and nothing is left running."""
    started = []
    real_start = EngineProcessClient._start

    def start_then_kill(self, config, env=None):
        real_start(self, config, env)
        started.append(self._process)
        os.kill(self._process.pid, signal.SIGKILL)

    monkeypatch.setattr(EngineProcessClient, "_start", start_then_kill)
    with pytest.raises(EngineDeadError, match="killed by SIGKILL while loading the model"):
        await EngineProcessClient.create(engine_config(tiny_llama_dir))
    assert started[0].poll() is not None


async def test_an_engine_plugin_that_cannot_be_imported_stops_the_start(tiny_llama_dir):
    env = {**os.environ, "LLMRPC_ENGINE_PLUGINS": "engine_plugin, no_such_plugin_module"}
    with pytest.raises(Exception, match="no_such_plugin_module"):
        engine = await EngineProcessClient.create(engine_config(tiny_llama_dir), env=env)
        await engine.shutdown()


async def test_a_utility_nobody_registered_is_refused_by_name(tiny_llama_dir):
    engine = await EngineProcessClient.create(engine_config(tiny_llama_dir))
    try:
        with pytest.raises(ValueError, match="no engine utility named 'call_nothing'"):
            await engine.call_utility("call_nothing")
        assert await call_in_core(engine, engine_hooks.weights_device) == "cpu"  # the tests'
    finally:
        await engine.shutdown()
