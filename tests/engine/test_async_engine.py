"""AsyncEngine: the step loop runs off the event loop; a consumer that leaves frees its blocks."""

from __future__ import annotations

import asyncio

import pytest

from llmrpc.engine.async_engine import AsyncEngine, EngineStateError
from llmrpc.engine.config import CacheConfig, EngineConfig, ModelConfig
from llmrpc.engine.request import FinishReason, InvalidRequestError, SamplingParams

LONG = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)


@pytest.fixture
async def engine(tiny_llama_dir):
    config = EngineConfig(
        model=ModelConfig(model=str(tiny_llama_dir), dtype="float32", max_model_len=512),
        cache=CacheConfig(num_gpu_blocks_override=128),
    )
    engine = await AsyncEngine.create(config)
    yield engine
    await engine.shutdown()


def tokens(outputs) -> list[int]:
    return [t for output in outputs for t in output.token_ids]


async def collect(engine, request_id, prompt, params):
    outputs = [o async for o in engine.generate(request_id, prompt, params)]
    return outputs


async def test_cancelled_consumer_aborts_its_request_and_others_finish(engine):
    total = engine.stats.num_total_blocks
    prompt = engine.tokenizer.encode("A long story begins")
    first_output = asyncio.Event()

    async def victim():
        async for _ in engine.generate("victim", prompt, LONG):
            first_output.set()

    victim_task = asyncio.create_task(victim())
    others = [
        asyncio.create_task(collect(engine, f"o{i}", prompt, SamplingParams(max_tokens=40)))
        for i in range(3)
    ]
    await asyncio.wait_for(first_output.wait(), 30)
    victim_task.cancel()
    results = await asyncio.wait_for(asyncio.gather(*others), 60)
    assert all(r[-1].finished and r[-1].num_output_tokens == 40 for r in results)
    for _ in range(100):  # the abort is applied by the step loop
        if engine.stats.num_free_blocks == total:
            break
        await asyncio.sleep(0.05)
    assert engine.stats.num_free_blocks == total
    assert engine.stats.num_running == 0


async def test_abort_ends_the_stream_with_an_abort_reason(engine):
    prompt = engine.tokenizer.encode("Abort me")
    outputs = []
    async for output in engine.generate("a", prompt, LONG):
        outputs.append(output)
        if len(outputs) == 1:
            assert await engine.abort(["a", "unknown"]) == ["a"]
    assert outputs[-1].finish_reason is FinishReason.ABORT
    assert await engine.abort(["a"]) == []  # idempotent


async def test_bad_requests_fail_alone(engine):
    prompt = engine.tokenizer.encode("Hello")
    good = asyncio.create_task(collect(engine, "good", prompt, SamplingParams(max_tokens=20)))
    with pytest.raises(InvalidRequestError) as error:
        await collect(engine, "bad", prompt, SamplingParams(temperature=-1))
    assert error.value.field == "temperature"
    with pytest.raises(InvalidRequestError) as error:
        await collect(engine, "long", prompt, SamplingParams(max_tokens=600))
    assert error.value.field == "max_tokens"
    with pytest.raises(InvalidRequestError) as error:
        await collect(engine, "empty", [], SamplingParams())
    assert error.value.field == "input"
    outputs = await good
    assert outputs[-1].num_output_tokens == 20


async def test_time_limit_ends_with_the_output_so_far(engine):
    prompt = engine.tokenizer.encode("Go on forever")
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True, time_limit_s=0.05)
    outputs = await collect(engine, "t", prompt, params)
    assert outputs[-1].finish_reason is FinishReason.TIME_LIMIT
    assert 0 < outputs[-1].num_output_tokens < 400


async def test_load_figures_and_prefix_cache_reset(engine):
    prompt = engine.tokenizer.encode("A shared prefix that spans more than one block " * 3)
    await collect(engine, "first", prompt, SamplingParams(max_tokens=4))
    second = await collect(engine, "second", prompt, SamplingParams(max_tokens=4))
    assert second[-1].num_cached_tokens > 0
    stats = engine.stats
    assert 0 < stats.prefix_cache_hit_rate < 1
    assert stats.generation_throughput > 0 and stats.prompt_throughput > 0
    assert stats.kv_cache_usage == 0.0
    assert await engine.reset_prefix_cache()
    third = await collect(engine, "third", prompt, SamplingParams(max_tokens=4))
    assert third[-1].num_cached_tokens == 0


async def test_sleep_needs_sleep_mode(engine):
    with pytest.raises(EngineStateError, match="--enable-sleep-mode"):
        await engine.sleep(1)


@pytest.mark.parametrize("level", [1, 2])
async def test_sleep_and_wake_up_keep_the_output(tiny_llama_dir, level):
    config = EngineConfig(
        model=ModelConfig(str(tiny_llama_dir), dtype="float32", enable_sleep_mode=True),
        cache=CacheConfig(num_gpu_blocks_override=64),
    )
    engine = await AsyncEngine.create(config)
    try:
        prompt = engine.tokenizer.encode("Sleep well")
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        before = await collect(engine, "before", prompt, params)
        await engine.sleep(level)
        assert engine.is_sleeping and engine.core.runner.kv_caches == []
        assert (engine.core.model is None) == (level == 2)
        with pytest.raises(EngineStateError):
            await collect(engine, "asleep", prompt, params)
        await engine.wake_up()
        after = await collect(engine, "after", prompt, params)
        assert not engine.is_sleeping
        assert tokens(after) == tokens(before) and len(tokens(before)) == 8
    finally:
        await engine.shutdown()
