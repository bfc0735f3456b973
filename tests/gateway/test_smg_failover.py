"""A worker killed mid-run behind the smg router (PyPI smg 1.13.0): two ``llmrpc serve``
processes over gRPC, a run of concurrent OpenAI SDK requests, one server SIGKILLed while some of
them run on it; the router retries those on the other (its retry counter says so) and every
request of the run succeeds, streamed ones after the kill too.

About a minute on 2 cores (two servers start as processes of their own): ``make smg-proof``,
not ``make test``; tests/gateway/test_smg_router.py covers the rest in ``make test``."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_support import free_port, running_smg

pytestmark = pytest.mark.skipif(
    not os.environ.get("LLMRPC_SMG_PROOF"), reason="a longer proof: run by make smg-proof"
)


def start_serve(model_dir: Path, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [
        *(sys.executable, "-m", "llmrpc.cli", "serve", str(model_dir), "--dtype", "float32"),
        *("--num-gpu-blocks-override", "256", "--host", "127.0.0.1", "--grpc-port", str(port)),
        *("--no-rest-gateway", "--kv-events-config", '{"enable_kv_cache_events": true}'),
    ]
    with open(log, "w") as output:
        process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )  # fmt: skip
    return process, f"127.0.0.1:{port}"


def wait_serving(process: subprocess.Popen, address: str, log: Path, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, log.read_text()
        try:
            with grpc.insecure_channel(address) as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                answer = stub.Check(health_pb2.HealthCheckRequest(), timeout=2)
                if answer.status == health_pb2.HealthCheckResponse.SERVING:
                    return
        except grpc.RpcError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"llmrpc serve did not serve in {timeout} s:\n{log.read_text()}")


@pytest.fixture
def servers(tiny_llama_dir, tmp_path) -> Iterator[list[tuple[subprocess.Popen, str]]]:
    started = [start_serve(tiny_llama_dir, tmp_path / f"serve-{n}.log") for n in range(2)]
    try:
        for n, (process, address) in enumerate(started):
            wait_serving(process, address, tmp_path / f"serve-{n}.log")
        yield started
    finally:
        for process, _ in started:
            process.kill()
            process.wait(timeout=30)


def test_a_worker_killed_mid_run_and_the_routers_retries(servers, tmp_path):
    urls = [f"grpc://{address}" for _, address in servers]
    with running_smg(tmp_path, urls, "--policy", "round_robin") as smg:
        sdk = openai.OpenAI(base_url=smg.url + "/v1", api_key="unused", max_retries=0)
        (model,) = [m.id for m in sdk.models.list().data]
        retries_before = smg.metric("smg_worker_retries_total")

        def one(n: int):
            answer = sdk.completions.create(
                model=model, prompt=f"Item {n} of the run:", max_tokens=300, temperature=0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            return answer.usage.completion_tokens

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            run = [pool.submit(one, n) for n in range(24)]
            time.sleep(1.0)  # requests are running on both servers
            victim, _ = servers[0]
            victim.send_signal(signal.SIGKILL)
            results = [future.result(timeout=300) for future in run]
        assert victim.wait(timeout=30) == -signal.SIGKILL
        assert results == [300] * 24  # every request of the run, none lost with the worker
        assert smg.metric("smg_worker_retries_total") > retries_before  # retried elsewhere
        stream = sdk.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Still there?"}],
            max_tokens=5, stream=True, extra_body={"ignore_eos": True},
        )  # fmt: skip
        finish = [c.choices[0].finish_reason for c in stream if c.choices]
        assert finish[-1] == "length"
