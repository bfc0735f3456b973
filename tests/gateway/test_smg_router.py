"""The smg router (PyPI smg 1.13.0, its Rust binary) in front of llmrpc, the OpenAI SDK calling it.

gRPC: two llmrpc servers with the prefix cache's events on (``--kv-events-config``), served
under a name that is no folder (``--hide-model-path``), so the router builds its tokenizer from
their GetTokenizer; it tokenizes, calls vllm.grpc.engine.VllmEngine/Generate and detokenizes.
Its answers are the servers' own (greedy text as the v1 API gives it), streamed and not, and its
cache-aware routing reads their KV events: requests sharing a prefix go where its blocks are.
HTTP: the router in front of llmrpc's REST gateway. A worker killed mid-run and the router's
retries: tests/gateway/test_smg_failover.py (``make smg-proof``)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from envoy_support import NUM_KV_BLOCKS, Replica, ServerLoop
from gateway_support import in_process_gateway
from smg_support import Smg, running_smg

from llmrpc.engine.config import CacheConfig, EngineConfig, ModelConfig
from llmrpc.server.settings import FrontendConfig
from llmrpc.v1 import generation_pb2, generation_pb2_grpc

BLOCK = 16  # the engine's default --block-size


@pytest.fixture(scope="module")
def workers(server_loop: ServerLoop, tiny_llama_dir: Path) -> Iterator[list[Replica]]:
    """Two servers of the tiny model, engines on a thread (the test reads their caches)."""
    config = EngineConfig(
        model=ModelConfig(model=str(tiny_llama_dir), dtype="float32"),
        cache=CacheConfig(
            num_gpu_blocks_override=NUM_KV_BLOCKS,
            kv_events_config={"enable_kv_cache_events": True},
        ),
    )
    frontend = FrontendConfig(
        host="127.0.0.1",
        grpc_port=0,
        disable_frontend_multiprocessing=True,
        hide_model_path=True,
    )
    started = [server_loop.start_replica(config, frontend=frontend) for _ in range(2)]
    yield started
    for replica in started:
        replica.stop()


@pytest.fixture(scope="module")
def smg(workers: list[Replica], tmp_path_factory) -> Iterator[Smg]:
    urls = [f"grpc://{replica.address}" for replica in workers]
    log_dir = tmp_path_factory.mktemp("smg")
    with running_smg(log_dir, urls, "--policy", "cache_aware") as router:
        yield router


@pytest.fixture(scope="module")
def sdk(smg: Smg) -> openai.OpenAI:
    return openai.OpenAI(base_url=smg.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(sdk: openai.OpenAI) -> str:
    (served,) = sdk.models.list().data
    return served.id


def prompt_tokens_looked_up(replica: Replica) -> int:
    """Prompt tokens the replica's engine has looked up in its prefix cache: it grows by a
    request's prompt when that replica serves it."""
    return replica.running.engine.core.kv_manager.num_prefix_queries


def v1_text(server_loop, replica: Replica, prompt: str, max_tokens: int) -> str:
    async def generate():
        import grpc

        async with grpc.aio.insecure_channel(replica.address) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            request = generation_pb2.GenerateRequest(
                text=prompt, sampling={"temperature": 0.0}, stopping={"max_tokens": max_tokens}
            )
            return (await stub.Generate(request)).text

    return server_loop.run(generate())


def test_the_router_built_its_tokenizer_from_get_tokenizer(smg, model, workers):
    assert model == Path(workers[0].running.engine.model_info.model_dir).name  # no folder
    log = smg.log.read_text()  # no local folder of that name: the router asked a worker
    assert "Fetching tokenizer from worker: grpc://127.0.0.1:" in log
    assert "from GetTokenizer bundle" in log
    assert f"Successfully loaded tokenizer '{model}'" in log


def test_completions_are_the_servers_own_greedy_text(sdk, model, server_loop, workers):
    prompt = "The shepherd counted the sheep, and then"
    answer = sdk.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
    (choice,) = answer.choices
    assert choice.text == v1_text(server_loop, workers[0], prompt, 8)
    assert (choice.finish_reason, answer.usage.completion_tokens) == ("length", 8)


def test_chat_streamed_and_not_agree(sdk, model):
    messages = [{"role": "user", "content": "Name three colours of the rainbow."}]
    whole = sdk.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=10,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    stream = sdk.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    # the router's unary answer strips the text's outer whitespace (none left: no content)
    assert text.strip() == (whole.choices[0].message.content or "").strip()
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_cache_aware_routing_follows_the_kv_events(sdk, model, smg, workers):
    """A long shared prefix: the first request lands on one worker; once its blocks' events
    reach the router, every request sharing the prefix goes there and finds them cached."""
    prefix = " ".join(f"item{n}" for n in range(60))  # several full blocks
    hits_before = smg.metric("smg_cache_aware_policy_branch_total", branch="event_hit")
    blocks_before = smg.metric("smg_kv_event_blocks_total")
    served = []
    for n in range(5):
        before = [prompt_tokens_looked_up(r) for r in workers]
        answer = sdk.completions.create(
            model=model, prompt=f"{prefix} question {n}:", max_tokens=2, temperature=0
        )
        after = [prompt_tokens_looked_up(r) for r in workers]
        (worker,) = [i for i in range(2) if after[i] != before[i]]
        served.append((worker, answer.usage.prompt_tokens_details.cached_tokens))
        if n == 0:  # the prefix's blocks reach the router's index through the event stream
            deadline = time.monotonic() + 10
            while smg.metric("smg_kv_event_blocks_total") < blocks_before + 4:
                assert time.monotonic() < deadline, "no KV event reached the router"
                time.sleep(0.02)
    home = served[0][0]
    assert [worker for worker, _ in served] == [home] * 5, served
    assert all(cached >= 4 * BLOCK for _, cached in served[1:]), served
    hits = smg.metric("smg_cache_aware_policy_branch_total", branch="event_hit") - hits_before
    assert hits >= 4  # chosen by the events' index, not by a guess of the router's own
    for problem in ("gaps", "missed_batches", "resyncs", "stream_errors"):
        assert smg.metric(f"smg_kv_event_{problem}_total") == 0, problem


def test_smg_http_mode_in_front_of_the_rest_gateway(server_loop, workers, tmp_path):
    """HTTP mode: the router proxies the OpenAI API to llmrpc's REST gateway."""
    for gateway in in_process_gateway(server_loop, workers[1]):
        with running_smg(tmp_path, [gateway.url]) as router:
            sdk = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)
            (served,) = sdk.models.list().data
            prompt = "A gateway in front of a gateway"
            answer = sdk.completions.create(
                model=served.id, prompt=prompt, max_tokens=6, temperature=0
            )
            assert answer.choices[0].text == v1_text(server_loop, workers[1], prompt, 6)
            stream = sdk.chat.completions.create(
                model=served.id,
                messages=[{"role": "user", "content": "Hello"}],
                max_tokens=5,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
            whole = sdk.chat.completions.create(
                model=served.id,
                messages=[{"role": "user", "content": "Hello"}],
                max_tokens=5,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            assert "".join(pieces).strip() == (whole.choices[0].message.content or "").strip()
            (worker,) = router.workers()
            assert worker.get("connection_mode", "http").lower() == "http"
