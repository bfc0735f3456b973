"""``--data-parallel-size 2``: two engine processes behind one server. Requests are spread over
both and answer as one engine does; a prompt's prefix goes back to the engine that cached it;
Abort reaches the engine holding the request; figures add up; health is SERVING with both up,
and one engine's death stops the server (exit 1, cause logged). The frontend loads one tokenizer
set for both engines and tokenizes on its own workers."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import threading
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
from engine_pace import restore_speed, slow_down
from grpc_health.v1 import health_pb2, health_pb2_grpc
from server_utils import (
    NUM_KV_BLOCKS,
    frontend_config,
    read_rest,
    tiny_engine_config,
    wait_for_health,
    wait_until,
)

from llmrpc.engine.client.data_parallel import DataParallelClient, cpu_shares
from llmrpc.engine.loading import loader
from llmrpc.engine.request import SamplingParams
from llmrpc.server import app, options, servicers
from llmrpc.v1 import admin_pb2, admin_pb2_grpc, common_pb2, generation_pb2, generation_pb2_grpc
from llmrpc.vllm_engine import common_pb2 as vllm_common_pb2
from llmrpc.vllm_engine import vllm_engine_pb2, vllm_engine_pb2_grpc

pytestmark = pytest.mark.asyncio(loop_scope="module")

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# More than two KV blocks (16 tokens each) of prompt: its prefix is remembered.
SHARED = "The quick brown fox jumps over the lazy dog while the cat watches from the fence. " * 3
TOKENIZER_LOADS: list[str] = []  # paths the server's process loaded tokenizers from, in order


def greedy(text: str | None = None, max_tokens: int = 8, **fields):
    """A greedy GenerateRequest of ``max_tokens`` tokens."""
    if text is not None:
        fields["text"] = text
    return generation_pb2.GenerateRequest(
        sampling=common_pb2.SamplingParams(temperature=0.0),
        stopping=common_pb2.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True),
        **fields,
    )


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def dp(tiny_llama_dir: Path):
    """``app.serve`` with two engine processes, as a task, once it serves; and its server. The
    tokenizers loaded in this process meanwhile are in ``TOKENIZER_LOADS``."""
    servers: list[app.RunningServer] = []
    real_build, real_load = app.build_server, loader.load_tokenizer
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(app, "build_server", lambda *a: servers.append(real_build(*a)) or servers[-1])
        patch.setattr(
            loader,
            "load_tokenizer",
            lambda path: TOKENIZER_LOADS.append(str(path)) or real_load(path),
        )
        frontend = frontend_config("process", data_parallel_size=2)
        config = tiny_engine_config(tiny_llama_dir)  # with the prefix cache's events
        events = {"enable_kv_cache_events": True}
        config = dataclasses.replace(
            config, cache=dataclasses.replace(config.cache, kv_events_config=events)
        )
        serving = asyncio.ensure_future(app.serve(config, frontend))
        await wait_until(lambda: servers and servers[0].port, timeout=60, what="the bind")
        running = servers[0]
        async with grpc.aio.insecure_channel(running.address) as channel:
            await wait_for_health(channel, SERVING, timeout=120)
    yield serving, running
    if not serving.done():  # the last test did not end it: stop it as SIGTERM does
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.wait_for(serving, timeout=60)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def channel(dp):
    async with grpc.aio.insecure_channel(dp[1].address) as channel:
        yield channel


@pytest.fixture(scope="module")
def engine(dp) -> DataParallelClient:
    return dp[1].engine


@pytest.fixture(scope="module")
def generation(channel):
    return generation_pb2_grpc.GenerationServiceStub(channel)


@pytest.fixture(scope="module")
def admin(channel):
    return admin_pb2_grpc.AdminServiceStub(channel)


async def test_two_engine_processes_split_the_cores_and_health_is_serving(channel, engine):
    assert isinstance(engine, DataParallelClient)
    pids = engine.pids
    assert len(set(pids)) == 2 and all(engine.is_running for engine in engine.engines)
    status = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    assert status.status == SERVING
    if not os.environ.get("OMP_NUM_THREADS", "").strip():
        shares = cpu_shares(2, len(os.sched_getaffinity(0)))
        for pid, share in zip(pids, shares, strict=True):
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            assert f"OMP_NUM_THREADS={share}".encode() in environ


async def test_one_tokenizer_set_for_both_engines_and_prompts_tokenized_on_its_workers(
    dp, generation, monkeypatch
):
    """The server's process loads one tokenizer for both engines (each engine process loads its
    own to detokenize), and the servicers tokenize on the frontend's own worker threads."""
    running = dp[1]
    assert len(TOKENIZER_LOADS) == 1, TOKENIZER_LOADS
    threads = []
    real = servicers._to_engine_request
    monkeypatch.setattr(
        servicers,
        "_to_engine_request",
        lambda *args: threads.append(threading.current_thread()) or real(*args),
    )
    await asyncio.gather(*(generation.Generate(greedy(f"Hello {i}", 2)) for i in range(4)))
    workers = running.tokenization.workers.threads
    assert len(threads) == 4 and set(threads) <= workers, (threads, workers)
    assert all(thread.name.startswith("llmrpc-tokenizer") for thread in threads)


async def test_concurrent_requests_use_both_engines_and_match_one_engine(generation, engine):
    prompts = [[100 + 7 * i, 200 + i, 300, 400 + 11 * i, 500] for i in range(8)]
    before = list(engine.balancer.num_routed)
    replies = await asyncio.gather(
        *(generation.Generate(greedy(token_ids=common_pb2.TokenIds(ids=p))) for p in prompts)
    )
    routed = [now - then for now, then in zip(engine.balancer.num_routed, before, strict=True)]
    assert sum(routed) == 8 and min(routed) >= 2, routed
    # The same prompts one at a time on one engine: what a server with one engine answers
    # (greedy in float32: the batch does not change the tokens).
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    expected = []
    for i, prompt in enumerate(prompts):
        outputs = [o async for o in engine.engines[0].generate(f"alone-{i}", prompt, params)]
        expected.append([token for output in outputs for token in output.token_ids])
    assert [list(reply.token_ids) for reply in replies] == expected


async def test_a_known_prefix_goes_back_to_the_engine_that_cached_it(generation, admin, engine):
    assert (await admin.ResetPrefixCache(admin_pb2.ResetPrefixCacheRequest())) is not None
    first = await generation.Generate(greedy(SHARED + "First."))
    holder = engine.balancer._last
    # In turn, the next request with no known prefix goes to the other engine...
    await generation.Generate(greedy("Something else"))
    assert engine.balancer._last != holder
    # ...while the shared prefix goes back where its blocks are cached.
    again = await generation.Generate(greedy(SHARED + "Second."))
    assert engine.balancer._last == holder
    assert first.usage.cached_tokens == 0
    assert again.usage.cached_tokens >= 32


async def test_abort_reaches_the_engine_holding_the_request(generation, admin, engine):
    for each in engine.engines:
        slow_down(each, 0.02)
    try:
        calls = [
            generation.GenerateStream(greedy("Hello", 400, request_id=f"dp-{i}")) for i in (0, 1)
        ]
        for call in calls:
            await call.read()
        holders = [engine.engine_of(f"dp-{i}") for i in (0, 1)]
        assert sorted(holders) == [0, 1]
        aborted = await admin.Abort(admin_pb2.AbortRequest(request_ids=["dp-0", "unknown"]))
        assert list(aborted.aborted_request_ids) == ["dp-0"]
        last = (await read_rest(calls[0]))[-1]
        assert last.finish_reason == generation_pb2.FINISH_REASON_ABORT
        held, other = engine.engines[holders[0]], engine.engines[holders[1]]
        await wait_until(lambda: held.stats.num_running == 0, what="the abort in its engine")
        assert other.stats.num_running == 1  # the other request goes on
        calls[1].cancel()
        await wait_until(lambda: engine.stats.num_running == 0, what="the cancellation")
    finally:
        for each in engine.engines:
            restore_speed(each)


async def test_get_load_adds_both_engines_figures(admin, engine):
    load = await admin.GetLoad(admin_pb2.GetLoadRequest())
    assert load.num_kv_blocks == 2 * NUM_KV_BLOCKS
    assert [each.num_kv_blocks for each in load.engines] == [NUM_KV_BLOCKS] * 2
    assert [s.num_total_blocks for s in engine.engine_stats] == [NUM_KV_BLOCKS] * 2


async def test_vllm_engine_service_pins_ranks_and_reports_both(channel, engine):
    """vLLM's engine service (the smg router's way in): data_parallel_rank pins a request to
    that engine, whose KV events say its rank; loads and facts cover both engines."""
    vllm = vllm_engine_pb2_grpc.VllmEngineStub(channel)
    info = await vllm.GetServerInfo(vllm_engine_pb2.GetServerInfoRequest())
    assert info.data_parallel_size == 2
    loads = await vllm.GetLoads(vllm_engine_pb2.GetLoadsRequest())
    assert [load.dp_rank for load in loads.loads] == [0, 1] and loads.dp_rank_count == 2
    events = vllm.SubscribeKvEvents(vllm_common_pb2.SubscribeKvEventsRequest())
    await events.initial_metadata()
    for rank in (1, 0):
        request = vllm_engine_pb2.GenerateRequest(
            tokenized={"input_ids": list(range(500 + rank, 540 + rank))},
            sampling_params={"temperature": 0.0, "max_tokens": 2},
            data_parallel_rank=rank,
        )
        (done,) = [r async for r in vllm.Generate(request)]
        assert done.complete.completion_tokens == 2
        batch = await asyncio.wait_for(events.read(), timeout=30)
        stored = [e.stored for e in batch.events if e.HasField("stored")]
        assert batch.dp_rank == rank and stored[0].blocks[0].token_ids[0] == 500 + rank
    events.cancel()
    request = vllm_engine_pb2.GenerateRequest(tokenized={"input_ids": [1]}, data_parallel_rank=2)
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await vllm.Generate(request).read()
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_data_parallel_flags_that_cannot_work_here_are_refused_with_the_way_out():
    parser = argparse.ArgumentParser(add_help=False)
    options.add_serve_arguments(parser)

    def refusal(*argv: str) -> str:
        serve = options.parse_serve_values(parser, ["model", *argv])
        with pytest.raises(ValueError) as refused:
            options.build_configs(serve)
        return str(refused.value)

    assert "--disable-frontend-multiprocessing" in refusal(
        "-dp", "2", "--disable-frontend-multiprocessing"
    )
    assert "--data-parallel-size-local 1" in refusal("-dp", "2", "--data-parallel-size-local", "1")
    for argv in (("--data-parallel-address", "10.0.0.1"), ("--data-parallel-backend", "ray")):
        assert "Envoy" in refusal(*argv) and "Kubernetes" in refusal(*argv)
    _, frontend = options.build_configs(
        options.parse_serve_values(parser, ["model", "-dp", "2", "-dpl", "2"])
    )
    assert (frontend.data_parallel_size, frontend.data_parallel_size_local) == (2, 2)


async def test_one_engine_killed_turns_not_serving_and_serve_exits_1(dp, channel, caplog):
    """Last: it ends the module's server."""
    serving, running = dp
    pid = running.engine.pids[1]
    watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
    assert (await watch.read()).status == SERVING
    with caplog.at_level(logging.ERROR):
        os.kill(pid, signal.SIGKILL)
        assert (await watch.read()).status == NOT_SERVING
        assert await asyncio.wait_for(serving, timeout=60) == 1
    died = [r.getMessage() for r in caplog.records if "the engine died" in r.getMessage()]
    assert died and f"data-parallel engine 1: the engine process (pid {pid}) was killed" in died[0]
