"""``llmrpc admin`` against a server with --admin-api-key: a generation key is refused with the
auth exit code and a line saying why; the admin key, from --api-key or LLMRPC_ADMIN_API_KEY
(which admin verbs prefer to LLMRPC_API_KEY, so one environment can hold both), is served."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from client_utils import ServerThread, tiny_engine_config

from llmrpc.clients.cli import common
from llmrpc.server.settings import FrontendConfig

LLMRPC = str(Path(sys.executable).parent / "llmrpc")
GENERATION_KEY, ADMIN_KEY = "gen-key-1234", "admin-key-5678"


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path) -> Iterator[ServerThread]:
    frontend = FrontendConfig(
        host="127.0.0.1", grpc_port=0, api_key=(GENERATION_KEY,), admin_api_key=(ADMIN_KEY,)
    )
    server = ServerThread(tiny_engine_config(tiny_llama_dir), frontend=frontend)
    yield server
    server.stop()


def admin(server, *args: str, **env: str) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("LLMRPC_")}
    command = [LLMRPC, "admin", *args, "--target", server.address]
    return subprocess.run(
        command, capture_output=True, text=True, timeout=120, env={**environment, **env}
    )


def test_a_generation_key_is_refused_with_the_auth_exit_code(server):
    result = admin(server, "reset-prefix-cache", LLMRPC_API_KEY=GENERATION_KEY)
    assert result.returncode == common.EXIT_AUTH, result.stderr
    assert "admin" in result.stderr
    info = admin(server, "info", LLMRPC_API_KEY=GENERATION_KEY)
    assert info.returncode == common.EXIT_OK, info.stderr
    assert json.loads(info.stdout)["server"]["admin_auth_required"] is True


def test_the_admin_key_from_the_flag_or_its_own_variable_is_served(server):
    flag = admin(server, "reset-prefix-cache", "--api-key", ADMIN_KEY)
    assert flag.returncode == common.EXIT_OK, flag.stderr
    both = {"LLMRPC_API_KEY": GENERATION_KEY, "LLMRPC_ADMIN_API_KEY": ADMIN_KEY}
    result = admin(server, "reset-prefix-cache", **both)
    assert result.returncode == common.EXIT_OK, result.stderr
    assert json.loads(result.stdout) == {"prefix_cache_reset": True}
