"""REST callers without keys take turns by connection, as llmrpc serve's gateway runs: one
caller's completion of six prompts, queued for the engine's one seat, does not hold back another
caller's single prompt, which is answered while the six are still being computed (it used to
wait for all of them: every keyless REST call was one caller, the in-process channel)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from engine_pace import restore_speed, slow_down
from envoy_support import Replica, tiny_engine_config
from gateway_support import RunningGateway, gateway_settings, post, wait_serving

from llmrpc.engine.config import SchedulerConfig
from llmrpc.server.settings import FrontendConfig


@pytest.fixture(scope="module")
def replica(server_loop, tiny_llama_dir) -> Iterator[Replica]:
    """One seat in the batch."""
    engine_config = dataclasses.replace(
        tiny_engine_config(tiny_llama_dir), scheduler=SchedulerConfig(max_num_seqs=1)
    )
    frontend = FrontendConfig(host="127.0.0.1", grpc_port=0)
    started = server_loop.start_replica(engine_config, frontend=frontend)
    yield started
    started.stop()


@pytest.fixture(scope="module")
def gateway(server_loop, replica) -> Iterator[RunningGateway]:
    """As llmrpc serve runs it: the in-process channel, each caller's identity passed on."""
    settings = gateway_settings(["in-process"])
    backends = dataclasses.replace(settings.backends, forward_api_key=True)
    settings = dataclasses.replace(settings, backends=backends)
    started = RunningGateway(server_loop, settings, {"in-process": replica.running.loopback})
    try:
        wait_serving(started)
        yield started
    finally:
        started.stop()


def completion(gateway, prompt) -> dict:
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    reply = post(gateway, "/v1/completions", body)
    assert reply.status_code == 200, reply.text
    return reply.json()


def one_runs_five_wait(engine) -> bool:
    """The six prompts admitted: one running (--max-num-seqs 1), five waiting. All six can be
    waiting for a moment before the engine's next step takes one."""
    stats = engine.stats
    return (stats.num_running, stats.num_waiting) == (1, 5)


def test_another_callers_prompt_is_answered_while_a_big_batch_runs(gateway, replica):
    engine = replica.running.engine
    slow_down(engine, 0.01)
    try:
        with ThreadPoolExecutor(1) as pool:
            batch = pool.submit(completion, gateway, [f"Story {i}" for i in range(6)])
            deadline = time.monotonic() + 30
            while not one_runs_five_wait(engine) and time.monotonic() < deadline:
                time.sleep(0.005)
            assert one_runs_five_wait(engine), engine.stats
            assert len(completion(gateway, "Hello")["choices"]) == 1
            assert not batch.done()  # A's batch runs on
            assert len(batch.result()["choices"]) == 6
    finally:
        restore_speed(engine)
