"""Callers take turns for the engine's seats: a request of a second API key, sent while the
first key's six wait for the one seat, finishes after at most two of them (it used to finish
last: first come first served across callers)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from types import SimpleNamespace

import pytest
import pytest_asyncio
from engine_pace import restore_speed, slow_down
from server_utils import frontend_config, tiny_engine_config, wait_until

from llmrpc.engine.config import SchedulerConfig
from llmrpc.server.app import RunningServer, start_server
from llmrpc.server.auth import Caller, caller_var, fair_share_caller
from llmrpc.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from llmrpc.v1.headers import CLIENT

on_the_servers_loop = pytest.mark.asyncio(loop_scope="module")
KEYS = ("key-a", "key-b")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(tiny_llama_dir, engine_mode) -> AsyncIterator[RunningServer]:
    """One seat in the batch."""
    engine_config = dataclasses.replace(
        tiny_engine_config(tiny_llama_dir), scheduler=SchedulerConfig(max_num_seqs=1)
    )
    running = await start_server(engine_config, frontend=frontend_config(engine_mode, api_key=KEYS))
    yield running
    await running.stop(grace=0)


def request(max_tokens: int) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        text="Tell me a story",
        sampling=common_pb2.SamplingParams(temperature=0.0),
        stopping=common_pb2.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True),
    )


@on_the_servers_loop
async def test_another_keys_request_is_not_held_behind_a_whole_batch(server, channel):
    generation = generation_pb2_grpc.GenerationServiceStub(channel)
    finished: list[str] = []

    async def call(name: str, key: str, max_tokens: int) -> None:
        metadata = (("authorization", f"Bearer {key}"),)
        await generation.Generate(request(max_tokens), metadata=metadata)
        finished.append(name)

    slow_down(server.engine, 0.01)
    try:
        batch = [asyncio.ensure_future(call(f"a{i}", "key-a", 8)) for i in range(6)]
        await wait_until(lambda: server.engine.stats.num_waiting == 5, what="a's queued")
        await asyncio.gather(call("b", "key-b", 8), *batch)
    finally:
        restore_speed(server.engine)
    assert len(finished) == 7 and finished.index("b") <= 2, finished


@on_the_servers_loop
async def test_a_call_without_a_key_is_its_connections(server):
    """(Unit) the fair-share caller: the key's digest, else the connection: gRPC's peer, or
    on the in-process channel the REST connection llmrpc serve's gateway names."""
    context = SimpleNamespace(peer=lambda: "ipv4:127.0.0.1:40000")
    assert fair_share_caller(context) == "peer:ipv4:127.0.0.1:40000"
    in_process = SimpleNamespace(invocation_metadata=lambda: ())
    assert fair_share_caller(in_process) == "in-process"
    rest = SimpleNamespace(invocation_metadata=lambda: ((CLIENT, "127.0.0.1:5000"),))
    assert fair_share_caller(rest) == "rest:127.0.0.1:5000"
    spoofed = SimpleNamespace(peer=context.peer, invocation_metadata=rest.invocation_metadata)
    assert fair_share_caller(spoofed) == "peer:ipv4:127.0.0.1:40000"  # a network caller's own
    token = caller_var.set(Caller(bytes(range(32))))
    try:
        assert fair_share_caller(context) == "key:000102030405060708090a0b0c0d0e0f"[:20]
    finally:
        caller_var.reset(token)
