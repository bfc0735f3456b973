"""The smg router (PyPI ``smg``, the Rust "Shepherd Model Gateway": its ``smg`` command, from the
test environment) started in front of llmrpc workers, and what the tests read of it: its
Prometheus metrics, its workers."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

SMG = Path(sys.executable).parent / "smg"  # installed with the tests' extras (pyproject: dev)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass
class Smg:
    process: subprocess.Popen
    url: str  # the OpenAI-compatible API: {url}/v1/...
    metrics_url: str
    log: Path

    def metric(self, name: str, **labels: str) -> float:
        """The sum of the samples of ``name`` whose labels include ``labels``."""
        total = 0.0
        for line in httpx.get(self.metrics_url, timeout=10).text.splitlines():
            if not line.startswith(name + "{") and not line.startswith(name + " "):
                continue
            series, _, value = line.rpartition(" ")
            if all(f'{key}="{wanted}"' in series for key, wanted in labels.items()):
                total += float(value)
        return total

    def workers(self) -> list[dict]:
        return httpx.get(f"{self.url}/workers", timeout=10).json().get("workers", [])


@contextlib.contextmanager
def running_smg(
    log_dir: Path, worker_urls: list[str], *flags: str, workers_ready: int | None = None
) -> Iterator[Smg]:
    """``smg launch`` (router mode) in front of ``worker_urls``, once it routes to
    ``workers_ready`` of them (all, by default) with its tokenizer loaded."""
    port, metrics_port = free_port(), free_port()
    log = log_dir / f"smg-{port}.log"
    command = [
        str(SMG), "launch", "--host", "127.0.0.1", "--port", str(port),
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
        "--log-level", "info", "--worker-urls", *worker_urls, *flags,
    ]  # fmt: skip
    with open(log, "w") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)
    smg = Smg(process, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}/metrics", log)
    try:
        _wait_ready(smg, workers_ready if workers_ready is not None else len(worker_urls))
        yield smg
    finally:
        process.kill()  # nothing of the router's needs saving
        process.wait(timeout=10)


def _wait_ready(smg: Smg, num_workers: int, timeout: float = 120.0) -> None:
    """Until ``num_workers`` workers are healthy and a one-token completion comes back (the
    router has its tokenizer: registration finishes in the background)."""
    deadline = time.monotonic() + timeout
    problem = "no answer"
    while time.monotonic() < deadline:
        if smg.process.poll() is not None:
            raise RuntimeError(f"smg exited ({smg.process.returncode}):\n{smg.log.read_text()}")
        try:
            healthy = [w for w in smg.workers() if w.get("is_healthy", True)]
            models = httpx.get(f"{smg.url}/v1/models", timeout=10).json().get("data", [])
            if len(healthy) >= num_workers and models:
                trial = {"model": models[0]["id"], "prompt": "Hi", "max_tokens": 1}
                answer = httpx.post(f"{smg.url}/v1/completions", json=trial, timeout=30)
                if answer.status_code == 200:
                    return
                problem = f"a trial completion: {answer.status_code} {answer.text}"
            else:
                problem = f"{len(healthy)} healthy worker(s), models {models}"
        except (httpx.HTTPError, ValueError) as error:
            problem = repr(error)
        time.sleep(0.2)
    raise TimeoutError(f"smg not ready after {timeout} s ({problem}):\n{smg.log.read_text()}")
