"""The engine core in a process of its own (``llmrpc serve``'s default): if that process dies, the
calls in flight get UNAVAILABLE, health turns NOT_SERVING and the server exits 1 with the cause
in its log; stopped by SIGTERM, the server stops its engine process and leaves none behind."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from process_state import children_of, process_ended
from server_utils import frontend_config, serve_in_process, wait_until

from llmrpc.v1 import common_pb2, generation_pb2, generation_pb2_grpc

pytestmark = pytest.mark.asyncio(loop_scope="module")

NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVING = health_pb2.HealthCheckResponse.SERVING
LONG = generation_pb2.GenerateRequest(
    text="Hello", stopping=common_pb2.StoppingCriteria(max_tokens=400, ignore_eos=True)
)


async def health_status(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return (await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)).status


async def test_a_killed_engine_process_fails_calls_turns_not_serving_and_serve_exits_1(
    tiny_llama_dir, monkeypatch, caplog
):
    frontend = frontend_config("process", drain_delay_s=5)  # not waited: the engine is dead
    serving, running = await serve_in_process(tiny_llama_dir, frontend, monkeypatch, timeout=120)
    pid = running.engine.pid
    statuses = []
    async with grpc.aio.insecure_channel(running.address) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
        statuses.append((await watch.read()).status)
        stream = generation_pb2_grpc.GenerationServiceStub(channel).GenerateStream(LONG)
        await stream.read()
        started = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            while await stream.read() is not grpc.aio.EOF:
                pass
        assert failure.value.code() == grpc.StatusCode.UNAVAILABLE
        assert f"(pid {pid}) was killed by SIGKILL" in failure.value.details()
        status = await watch.read()
        statuses.append(status.status if status is not grpc.aio.EOF else None)
        assert await asyncio.wait_for(serving, timeout=30) == 1
    assert time.monotonic() - started < 10  # no drain delay for a dead engine
    assert statuses == [SERVING, NOT_SERVING]
    died = [r for r in caplog.records if r.getMessage().startswith("the engine died")]
    assert died and died[0].levelno == logging.ERROR
    assert f"the engine process (pid {pid}) was killed by SIGKILL" in died[0].getMessage()


async def _is(awaitable, expected) -> bool:
    return await awaitable == expected


# --- the llmrpc command ---------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


async def start_llmrpc_serve(
    model_dir: Path, rest_port: int | None = None
) -> tuple[subprocess.Popen, int, str]:
    """``llmrpc serve`` of the tiny model with the default engine mode, once it serves; the
    process, its engine process's id, and its gRPC address. The REST gateway only on
    ``rest_port``."""
    port = free_port()
    rest = ("--no-rest-gateway",) if rest_port is None else ("--port", str(rest_port))
    command = [
        *(sys.executable, "-m", "llmrpc.cli", "serve", str(model_dir)),
        *("--dtype", "float32", "--num-gpu-blocks-override", "64", "--max-model-len", "256"),
        *("--host", "127.0.0.1", "--grpc-port", str(port), *rest),
    ]
    server = subprocess.Popen(
        command,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    address = f"127.0.0.1:{port}"

    async def serving() -> bool:
        assert server.poll() is None, server.stderr.read()
        try:
            return await health_status(address) == SERVING
        except grpc.aio.AioRpcError:
            return False

    await wait_until(serving, timeout=180, what="llmrpc serve to serve")
    children = children_of(server.pid)
    assert len(children) == 1, children
    return server, children[0], address


async def test_llmrpc_serve_exits_1_naming_the_cause_when_its_engine_process_is_killed(
    tiny_llama_dir,
):
    server, engine_pid, _ = await start_llmrpc_serve(tiny_llama_dir)
    try:
        os.kill(engine_pid, signal.SIGKILL)
        assert await asyncio.to_thread(server.wait, 60) == 1
        log = server.stderr.read()
    finally:
        server.kill()
    assert f"the engine process (pid {engine_pid}) was killed by SIGKILL" in log
    assert "the engine died; the server stops" in log


async def test_llmrpc_serve_stopped_by_sigterm_stops_its_engine_process(tiny_llama_dir):
    server, engine_pid, _ = await start_llmrpc_serve(tiny_llama_dir)
    try:
        server.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(server.wait, 60) == 0
        log = server.stderr.read()
    finally:
        server.kill()
    assert process_ended(engine_pid), log
    assert "engine died" not in log


def loads_torch(pid: int) -> bool:
    return "libtorch_cpu" in Path(f"/proc/{pid}/maps").read_text()


async def test_llmrpc_serve_loads_torch_in_its_engine_process_only(tiny_llama_dir):
    """The frontend (gRPC, REST gateway, tokenizing, chat templates) runs without torch, which
    the engine process loads: ~220 MB of RSS less. Served over both APIs, nothing in the
    frontend reaches for it, and transformers' notice of its absence is not logged."""
    rest_port = free_port()
    server, engine_pid, address = await start_llmrpc_serve(tiny_llama_dir, rest_port=rest_port)
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            reply = await stub.Generate(
                generation_pb2.GenerateRequest(
                    text="Hello", stopping=common_pb2.StoppingCriteria(max_tokens=4)
                ),
                timeout=60,
            )
        assert reply.text and reply.token_ids
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{rest_port}") as client:
            chat = await client.post(
                "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
                timeout=60,
            )
            assert chat.status_code == 200, chat.text
            streamed = await client.post(
                "/v1/completions",
                json={"prompt": "Hello", "max_tokens": 4, "stream": True, "logprobs": 2},
                timeout=60,
            )
            assert streamed.status_code == 200 and "[DONE]" in streamed.text, streamed.text
        assert loads_torch(engine_pid)
        assert not loads_torch(server.pid)
        server.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(server.wait, 60) == 0
        log = server.stderr.read()
    finally:
        server.kill()
    assert "PyTorch was not found" not in log and "Traceback" not in log, log
    if len(os.sched_getaffinity(0)) > 1 and not os.environ.get("OMP_NUM_THREADS", "").strip():
        # its own process's CPU time is the engine's: it may take the core left to the frontend
        assert re.search(r"CPU threads? while the rest of the machine uses half a core", log), log
