"""``llmrpc admin lora-load | lora-unload | lora-list`` in subprocesses against a real server with
--enable-lora (one adapter from --lora-modules): JSON on stdout, and a refused call as one line
on stderr with the "request rejected" exit code."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from client_utils import ServerThread, tiny_engine_config
from lora_adapters import AdapterSpec, make_adapter

from llmrpc.clients import Client
from llmrpc.clients.cli import common
from llmrpc.engine.lora.types import LoRAConfig, LoRAModulePath

LLMRPC = str(Path(sys.executable).parent / "llmrpc")


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory) -> dict[str, str]:
    """name -> the folder of a PEFT adapter of the tiny model."""
    made = {}
    specs = {"first": AdapterSpec(rank=8, alpha=16, seed=11), "second": AdapterSpec(4, 4, seed=12)}
    for name, spec in specs.items():
        folder = tmp_path_factory.mktemp(name)
        make_adapter(tiny_llama_dir, folder, spec)
        made[name] = str(folder)
    return made


@pytest.fixture(scope="module")
def server(tiny_llama_dir, adapters) -> Iterator[ServerThread]:
    lora = LoRAConfig(
        enabled=True, max_loras=2, lora_modules=(LoRAModulePath("first", adapters["first"]),)
    )
    config = dataclasses.replace(tiny_engine_config(tiny_llama_dir), lora=lora)
    server = ServerThread(config, host="127.0.0.1", port=0)
    yield server
    server.stop()


def admin(server, *args: str) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("LLMRPC_")}
    command = [LLMRPC, "admin", *args, "--target", server.address]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, env=environment)


def test_lora_verbs_load_list_and_unload(server, adapters):
    with Client(server.address) as client:
        base = client.models()[0].id
    listed = admin(server, "lora-list")
    assert listed.returncode == common.EXIT_OK, listed.stderr
    first = {"name": "first", "path": adapters["first"], "base_model_name": base}
    assert json.loads(listed.stdout) == [first]

    loaded = admin(server, "lora-load", "second", adapters["second"])
    assert loaded.returncode == common.EXIT_OK, loaded.stderr
    second = {"name": "second", "path": adapters["second"], "base_model_name": base}
    assert json.loads(loaded.stdout) == second
    with Client(server.address) as client:
        assert [a.name for a in client.lora_adapters()] == ["first", "second"]
        assert client.generate("Hi", lora="second", max_tokens=2).text is not None
    assert json.loads(admin(server, "lora-list").stdout) == [first, second]

    unloaded = admin(server, "lora-unload", "second")
    assert unloaded.returncode == common.EXIT_OK, unloaded.stderr
    assert json.loads(unloaded.stdout) == {"unloaded": "second"}
    assert json.loads(admin(server, "lora-list").stdout) == [first]
    named = admin(server, "lora-load", "third", adapters["second"], "--base-model-name", base)
    assert json.loads(named.stdout)["base_model_name"] == base, named.stderr
    assert admin(server, "lora-unload", "third").returncode == common.EXIT_OK


@pytest.mark.parametrize(
    ("args", "status"),
    [
        (("lora-load", "first", "{first}"), "ALREADY_EXISTS"),
        (("lora-load", "third", "/no/such/folder"), "INVALID_ARGUMENT"),
        (("lora-unload", "never-loaded"), "NOT_FOUND"),
    ],
    ids=["name-in-use", "no-folder", "not-loaded"],
)
def test_refused_lora_verbs_say_why_with_the_rejected_exit_code(server, adapters, args, status):
    result = admin(server, *(arg.format(**adapters) for arg in args))
    assert (result.returncode, result.stdout) == (common.EXIT_REJECTED, ""), result.stderr
    assert result.stderr.count("\n") == 1
    assert result.stderr.startswith(f"llmrpc: error: {status}: ")


def test_lora_load_without_a_path_is_a_usage_error(server):
    result = admin(server, "lora-load", "only-a-name")
    assert result.returncode == common.EXIT_USAGE
    assert "PATH" in result.stderr
