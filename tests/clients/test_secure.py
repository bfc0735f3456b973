"""The clients against a server with TLS (then mTLS) and an API key: every method works with
the right credentials; a missing or wrong key, certificate or server name fails as it should."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
import pytest_asyncio
from client_utils import Caller, ServerThread, tiny_engine_config
from tls_certs import CertificateAuthority

from llmrpc.clients import AsyncClient, Client, FinishReason, LlmrpcError, RetryPolicy
from llmrpc.clients.cli import common
from llmrpc.server.settings import FrontendConfig, TLSConfig

API_KEY = "test-key-1"
NO_RETRIES = RetryPolicy(max_attempts=1)
LLMRPC = str(Path(sys.executable).parent / "llmrpc")


@pytest.fixture(scope="module")
def certificates(tmp_path_factory):
    ca = CertificateAuthority(tmp_path_factory.mktemp("certs"))
    server = ca.issue("server", server=True, dns_names=("llmrpc.test",))
    client = ca.issue("client", server=False)
    return SimpleNamespace(
        ca=ca.cert,
        server_cert=server.cert,
        server_key=server.key,
        client_cert=client.cert,
        client_key=client.key,
    )


@pytest.fixture(scope="module", params=["tls", "mtls"])
def secure_server(request, tiny_llama_dir, certificates):
    """A server with an API key and TLS; with "mtls", client certificates are required too."""
    mtls = request.param == "mtls"
    tls = TLSConfig(
        keyfile=str(certificates.server_key),
        certfile=str(certificates.server_cert),
        ca_certs=str(certificates.ca) if mtls else None,
        cert_reqs=2 if mtls else 0,
    )
    frontend = FrontendConfig(host="127.0.0.1", grpc_port=0, api_key=(API_KEY,), tls=tls)
    config = tiny_engine_config(tiny_llama_dir)
    config = replace(config, model=replace(config.model, enable_sleep_mode=True))
    server = ServerThread(config, frontend=frontend)
    yield server, mtls
    server.stop()


def credentials(certificates, mtls: bool, **overrides) -> dict:
    """The client options that this server accepts, with ``overrides`` applied."""
    options = {"ca_cert": certificates.ca, "api_key": API_KEY, "retry": NO_RETRIES}
    if mtls:
        options |= {"client_cert": certificates.client_cert, "client_key": certificates.client_key}
    return options | overrides


@pytest_asyncio.fixture(params=["sync", "async"])
async def connect(request, secure_server, certificates):
    """Make a ``Caller`` for the secure server with the right credentials, less ``overrides``."""
    server, mtls = secure_server
    client_class = AsyncClient if request.param == "async" else Client
    callers = []

    def make(**overrides) -> Caller:
        options = credentials(certificates, mtls, **overrides)
        callers.append(Caller(client_class(server.address, **options)))
        return callers[-1]

    yield make
    for caller in callers:
        await caller.close()


async def test_every_method_works_with_the_right_credentials(connect):
    call = connect()
    greedy = {"temperature": 0.0, "ignore_eos": True, "max_tokens": 3}
    completion = await call("generate", "Hello", **greedy)
    assert completion.finish_reason is FinishReason.LENGTH
    deltas = await call.collect("stream", "Hello", **greedy)
    assert [t for d in deltas for t in d.token_ids] == completion.token_ids
    messages = [{"role": "user", "content": "Hi"}]
    chat = await call("chat", messages, **greedy)
    assert [
        t for d in await call.collect("chat_stream", messages, **greedy) for t in d.token_ids
    ] == chat.token_ids
    tokens = await call("tokenize", "Hello world", add_special_tokens=False)
    assert await call("detokenize", tokens.token_ids) == "Hello world"
    info = await call("server_info")
    assert info.tls and info.auth_required
    assert [m.id for m in await call("models")] == [(await call("model_info")).model]
    assert await call("abort", "no-such-request") == []
    assert await call("health") == "SERVING"
    assert (await call("load")).num_running_requests == 0
    await call("reset_prefix_cache")


async def test_sleep_and_wake_up(connect):
    call = connect()
    await call("sleep", 1)
    assert await call("is_sleeping")
    with pytest.raises(LlmrpcError) as caught:
        await call("generate", "Hello", max_tokens=1)
    assert caught.value.code is grpc.StatusCode.FAILED_PRECONDITION
    await call("wake_up")
    assert not await call("is_sleeping")
    assert (await call("generate", "Hello", max_tokens=1)).usage.completion_tokens == 1


@pytest.mark.parametrize("api_key", [None, "wrong-key"])
async def test_a_missing_or_wrong_api_key_is_unauthenticated(connect, api_key):
    call = connect(api_key=api_key)
    with pytest.raises(LlmrpcError) as caught:
        await call("models")
    assert caught.value.code is grpc.StatusCode.UNAUTHENTICATED
    assert await call("health") == "SERVING"  # probes need no key


async def test_the_server_name_option_sets_the_name_checked(connect):
    assert await connect(server_name="llmrpc.test")("health") == "SERVING"
    with pytest.raises(LlmrpcError) as caught:
        await connect(server_name="not-in-the-certificate.test")("health")
    assert caught.value.code is grpc.StatusCode.UNAVAILABLE


async def test_plaintext_or_unverified_connections_fail(connect, certificates):
    for overrides in ({"ca_cert": None, "tls": False}, {"ca_cert": certificates.client_cert}):
        with pytest.raises(LlmrpcError) as caught:
            await connect(**overrides)("health")
        assert caught.value.code is grpc.StatusCode.UNAVAILABLE


async def test_a_client_certificate_is_needed_only_with_mtls(connect, secure_server):
    _, mtls = secure_server
    without_certificate = connect(client_cert=None, client_key=None)
    if not mtls:
        assert await without_certificate("health") == "SERVING"
        return
    with pytest.raises(LlmrpcError) as caught:
        await without_certificate("health")
    assert caught.value.code is grpc.StatusCode.UNAVAILABLE


def test_the_command_line_takes_tls_files_and_the_key_from_the_environment(
    secure_server, certificates
):
    server, mtls = secure_server
    flags = ["--url", server.address, "--ca-cert", str(certificates.ca)]
    if mtls:
        flags += ["--client-cert", str(certificates.client_cert)]
        flags += ["--client-key", str(certificates.client_key)]

    def run(env: dict) -> subprocess.CompletedProcess:
        return subprocess.run(
            [LLMRPC, "admin", "models", *flags],
            capture_output=True,
            text=True,
            timeout=60,
            env={k: v for k, v in os.environ.items() if k != "LLMRPC_API_KEY"} | env,
        )

    allowed = run({"LLMRPC_API_KEY": API_KEY})
    assert allowed.returncode == 0, allowed.stderr
    assert len(json.loads(allowed.stdout)) == 1
    refused = run({})
    assert refused.returncode == common.EXIT_AUTH
    assert "UNAUTHENTICATED" in refused.stderr
