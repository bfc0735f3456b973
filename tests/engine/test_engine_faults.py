"""Faults that belong to one request end that request alone; cancelled hand-offs are harmless.

Only a failed forward pass of the whole batch stops the engine. A fault in one request's
sampling, logits processing, detokenization, stop matching or output making finishes that
request with ``FinishReason.ERROR`` and the error text, while every other request in the batch
produces exactly the tokens it would have produced without the faulty one.
"""

from __future__ import annotations

import asyncio

import pytest
from engine_pace import restore_speed, slow_down

from llmrpc.engine import sampler as sampler_module
from llmrpc.engine.async_engine import AsyncEngine, EngineDeadError
from llmrpc.engine.config import CacheConfig, EngineConfig, ModelConfig
from llmrpc.engine.request import FinishReason, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True)
PROMPTS = {"a": "One two three", "b": "The quick brown fox", "bad": "Trouble ahead", "c": "Hi"}


@pytest.fixture
async def engine(tiny_llama_dir):
    config = EngineConfig(
        model=ModelConfig(model=str(tiny_llama_dir), dtype="float32", max_model_len=256),
        cache=CacheConfig(num_gpu_blocks_override=64),
    )
    engine = await AsyncEngine.create(config)
    yield engine
    await engine.shutdown()


async def run(engine, request_id: str, params: SamplingParams):
    prompt = engine.tokenizer.encode(PROMPTS[request_id])
    outputs = [o async for o in engine.generate(request_id, prompt, params)]
    return [t for o in outputs for t in o.token_ids], outputs[-1]


async def run_batch(engine, ids, params):
    return dict(zip(ids, await asyncio.gather(*(run(engine, i, params) for i in ids)), strict=True))


def fail_for(request_id: str, real):
    """``real`` that raises while any of its requests is ``request_id``."""

    def faulty(*args, **kwargs):
        for arg in args:
            requests = arg if isinstance(arg, list) else [arg]
            if any(getattr(r, "request_id", None) == request_id for r in requests):
                raise RuntimeError(f"injected fault for {request_id}")
        return real(*args, **kwargs)

    return faulty


async def test_cancelled_call_while_queued_for_the_engine_thread_is_harmless(engine):
    """A caller that gives up while its add_request waits behind a step must not kill the
    step loop (the engine thread would set a result on a cancelled future)."""
    slow_down(engine, 0.2)
    busy = asyncio.create_task(run(engine, "a", GREEDY))
    await asyncio.sleep(0.3)  # the engine thread is inside a slow step now
    for _ in range(5):
        late = asyncio.create_task(run(engine, "b", GREEDY))
        await asyncio.sleep(0.01)  # its add_request is queued behind the step
        late.cancel()
        with pytest.raises(asyncio.CancelledError):
            await late
        await asyncio.sleep(0.25)  # the engine thread applies (or skips) the queued command
    restore_speed(engine)
    tokens, last = await busy
    assert engine.is_running and last.num_output_tokens == 12
    assert (await run(engine, "c", GREEDY))[1].finish_reason is FinishReason.LENGTH
    assert engine.stats.num_running == engine.stats.num_waiting == 0
    assert engine.stats.num_free_blocks == engine.stats.num_total_blocks


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize(
    "where",
    ["logits_processors", "detokenizer", "stop_check", "make_output"],
)
async def test_a_fault_in_one_request_ends_it_alone(engine, monkeypatch, where, params):
    clean = await run_batch(engine, ["a", "b", "c"], params)
    core = engine.core
    if where == "logits_processors":  # inside the batched sampler call
        real = sampler_module.apply_logits_processors
        monkeypatch.setattr(sampler_module, "apply_logits_processors", fail_for("bad", real))
    elif where == "detokenizer":
        monkeypatch.setattr(
            core.output_processor, "add_token", fail_for("bad", core.output_processor.add_token)
        )
    elif where == "stop_check":
        monkeypatch.setattr(
            core.scheduler, "_check_token_stop", fail_for("bad", core.scheduler._check_token_stop)
        )
    else:
        monkeypatch.setattr(
            core.output_processor, "make_output", fail_for("bad", core.output_processor.make_output)
        )
    results = await run_batch(engine, ["a", "b", "bad", "c"], params)
    monkeypatch.undo()
    _, last = results.pop("bad")
    assert last.finished and last.finish_reason is FinishReason.ERROR
    assert "injected fault for bad" in last.error
    assert {k: v[0] for k, v in results.items()} == {k: v[0] for k, v in clean.items()}
    assert engine.is_running
    assert engine.stats.num_running == engine.stats.num_waiting == 0
    assert engine.stats.num_free_blocks == engine.stats.num_total_blocks
    assert (await run(engine, "c", params))[0] == clean["c"][0]


async def test_a_fault_in_prompt_logprobs_ends_that_request_alone(engine, monkeypatch):
    core = engine.core
    real = core.sampler.logprob_values

    def faulty(logits):
        if logits.shape[0] == len(engine.tokenizer.encode(PROMPTS["bad"])) - 1:
            raise RuntimeError("injected fault for bad")
        return real(logits)

    monkeypatch.setattr(core.sampler, "logprob_values", faulty)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=1)
    good = asyncio.create_task(run(engine, "b", GREEDY))
    _, last = await run(engine, "bad", params)
    assert last.finish_reason is FinishReason.ERROR and "injected" in last.error
    assert (await good)[1].num_output_tokens == 12


async def test_a_failed_forward_pass_stops_the_engine(engine, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("the device fell over")

    monkeypatch.setattr(engine.core.runner, "execute", broken)
    with pytest.raises(EngineDeadError, match="the device fell over"):
        await run(engine, "a", GREEDY)
    assert not engine.is_running


async def test_stats_and_tokenizers_are_safe_to_use_while_the_engine_runs(engine):
    """The event loop reads the engine's figures and tokenizes while the engine thread steps
    and detokenizes: each thread has its own tokenizer, and the figures are a snapshot."""
    params = SamplingParams(temperature=0.7, max_tokens=40, ignore_eos=True)
    ids = [f"r{i}" for i in range(8)]
    PROMPTS.update({i: f"Request {i} says hello" for i in ids})
    batch = asyncio.ensure_future(run_batch(engine, ids, params))
    text = "Tokenize me while the engine runs. " * 200
    reads = 0
    while not batch.done():
        stats = engine.stats
        assert 0.0 <= stats.kv_cache_usage <= 1.0 and stats.generation_throughput >= 0
        tokens = await engine.run_tokenizer(lambda tokenizer: tokenizer.encode(text))
        assert engine.tokenizer.decode(tokens[:5])
        reads += 1
    assert reads > 1
    assert all(last.num_output_tokens == 40 for _, last in (await batch).values())
