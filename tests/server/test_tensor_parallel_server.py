"""``llmrpc serve -tp 2``: serves, and a tensor-parallel rank that dies stops the server (exit 1,
the cause in its log) instead of leaving it hanging; no rank outlives it."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from process_state import children_of, process_ended
from server_utils import wait_until

from llmrpc.v1 import common_pb2, generation_pb2, generation_pb2_grpc

pytestmark = pytest.mark.asyncio(loop_scope="module")

SERVING = health_pb2.HealthCheckResponse.SERVING


def rank_worker_of(engine_pid: int) -> int:
    """The engine process's tensor-parallel worker (not multiprocessing's resource tracker)."""
    workers = [
        pid
        for pid in children_of(engine_pid)
        if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]
    assert len(workers) == 1, workers
    return workers[0]


async def serving(address: str) -> bool:
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
            return reply.status == SERVING
    except grpc.aio.AioRpcError:
        return False


async def test_a_killed_rank_stops_llmrpc_serve_with_the_cause(tiny_llama_dir):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    address = f"127.0.0.1:{port}"
    command = [
        *(sys.executable, "-m", "llmrpc.cli", "serve", str(tiny_llama_dir), "-tp", "2"),
        *("--dtype", "float32", "--num-gpu-blocks-override", "64", "--max-model-len", "256"),
        *("--host", "127.0.0.1", "--grpc-port", str(port), "--no-rest-gateway"),
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    server = subprocess.Popen(
        command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True, env=env,
    )  # fmt: skip
    try:
        await wait_until(lambda: server.poll() is None and serving(address), 180, "serving")
        async with grpc.aio.insecure_channel(address) as channel:
            reply = await generation_pb2_grpc.GenerationServiceStub(channel).Generate(
                generation_pb2.GenerateRequest(
                    text="Hello", stopping=common_pb2.StoppingCriteria(max_tokens=4)
                ),
                timeout=60,
            )
        assert len(reply.token_ids) == 4
        (engine_pid,) = children_of(server.pid)
        worker_pid = rank_worker_of(engine_pid)
        os.kill(worker_pid, signal.SIGKILL)  # the engine is idle: its stats refresh sees it
        assert await asyncio.to_thread(server.wait, 60) == 1
        log = server.stderr.read()
    finally:
        server.kill()
    assert f"tensor-parallel rank 1 (pid {worker_pid}) died, exit code -9" in log, log
    assert "the engine died; the server stops" in log
    assert process_ended(engine_pid)
