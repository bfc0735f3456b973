"""``llmrpc serve`` checks before it binds and binds before it loads: a bad flag value is one
line naming the flag (exit status 2) before any port is bound; a port in use is one line naming
the flag and the address (exit status 1), with no gRPC core log line; the model is loaded only
once every port is held. Real subprocesses of the command, on loopback."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

TIMEOUT_S = 180


def run_serve(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "llmrpc.cli", "serve", *args]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env=env,
        stdin=subprocess.DEVNULL,
    )


@contextlib.contextmanager
def port_in_use(host: str = "127.0.0.1") -> Iterator[int]:
    """A port some other program listens on."""
    with socket.socket() as taken:
        taken.bind((host, 0))
        taken.listen()
        yield taken.getsockname()[1]


def bad_values(model: Path, tmp_path: Path, port: int) -> dict[str, tuple[list[str], str]]:
    """name -> (serve arguments, the flag the error must name)."""
    text_file = tmp_path / "weights.bin"  # written by the test that uses it
    missing = tmp_path / "missing"
    tiny = [str(model)]
    return {
        "a model path that does not exist": ([str(missing)], "--model"),
        "a folder without config.json": ([str(tmp_path)], "--model"),
        "a file that is not .gguf": ([str(text_file)], "--model"),
        "a tokenizer that does not exist": ([*tiny, "--tokenizer", str(missing)], "--tokenizer"),
        "a generation config folder without its file": (
            [*tiny, "--generation-config", str(tmp_path)],
            "--generation-config",
        ),
        "a chat template file that does not exist": (
            [*tiny, "--chat-template", str(missing)],
            "--chat-template",
        ),
        "a TLS certificate that does not exist": (
            [*tiny, "--ssl-certfile", str(missing), "--ssl-keyfile", str(missing)],
            "--ssl-certfile",
        ),
        "middleware that cannot be imported": (
            [*tiny, "--middleware", "no_such_module.Middleware"],
            "--middleware",
        ),
        "the REST port the same as the gRPC port": ([*tiny, "--port", str(port)], "--port"),
    }


CASES = list(bad_values(Path("m"), Path("."), 1))


@pytest.mark.parametrize("case", CASES)
def test_a_bad_value_is_one_line_before_any_port_is_bound(case, tiny_llama_dir, tmp_path):
    # The gRPC port is taken: had serve bound before checking, it would fail on the port.
    (tmp_path / "weights.bin").write_text("not a model")
    with port_in_use() as port:
        args, flag = bad_values(tiny_llama_dir, tmp_path, port)[case]
        done = run_serve(*args, "--host", "127.0.0.1", "--grpc-port", str(port))
    assert done.returncode == 2, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"llmrpc serve: error: {flag}"), done.stderr


@pytest.mark.parametrize("flag", ["--grpc-port", "--port", "--health-port"])
def test_a_port_in_use_is_one_line_naming_the_flag_and_the_address(flag, tiny_llama_dir):
    ports = {"--grpc-port": "0", "--port": "0"}
    with port_in_use() as port:
        ports[flag] = str(port)
        listeners = [arg for item in ports.items() for arg in item]
        done = run_serve(
            str(tiny_llama_dir), "--load-format", "dummy", "--host", "127.0.0.1", *listeners
        )
    assert done.returncode == 1, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr  # no gRPC core line, no start-up of the other listeners
    assert (
        f" ERROR llmrpc.cli.serve: {flag} {port}: cannot listen on 127.0.0.1:{port}: " in lines[0]
    )
    assert lines[0].endswith("Address already in use"), lines[0]


def test_a_grpc_port_in_use_on_one_address_stops_serving_on_all_of_them(tiny_llama_dir):
    with port_in_use("127.0.0.1") as port:
        done = run_serve(
            str(tiny_llama_dir), "--load-format", "dummy", "--grpc-port", str(port), "--port", "0"
        )
    assert done.returncode == 1, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert f"--grpc-port {port}: cannot listen on [::]:{port}: Address already in use" in lines[0]
