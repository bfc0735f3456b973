"""Faults that belong to one request end that request alone; cancelled hand-offs are harmless.

Only a failed forward pass of the whole batch stops the engine. A fault in one request's
sampling, logits processing, detokenization, stop matching or output making finishes that
request with ``FinishReason.ERROR`` and the error text, while every other request in the batch
produces exactly the tokens it would have produced without the faulty one. Both modes: the
engine core on a thread of this process, and in a process of its own (faults are injected
where the core runs, with ``engine_hooks``).
"""

from __future__ import annotations

import asyncio
import logging
import re

import engine_hooks
import pytest
import pytest_asyncio
from engine_plugin import call_in_core

from llmrpc.engine.client.async_engine import AsyncEngine, EngineDeadError
from llmrpc.engine.client.process import EngineProcessClient
from llmrpc.engine.config import CacheConfig, EngineConfig, ModelConfig
from llmrpc.engine.request import FinishReason, SamplingParams
from llmrpc.server.tokenization import Tokenization

pytestmark = pytest.mark.asyncio(loop_scope="module")

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True)
PROMPTS = {"a": "One two three", "b": "The quick brown fox", "bad": "Trouble ahead", "c": "Hi"}
PROMPT_IDS: dict[str, list[int]] = {}  # PROMPTS in token ids (the engine clients take ids)
ENGINES = {"thread": AsyncEngine, "process": EngineProcessClient}


def engine_config(model_dir) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model=str(model_dir), dtype="float32", max_model_len=256),
        cache=CacheConfig(num_gpu_blocks_override=64),
    )


@pytest.fixture(scope="module", params=list(ENGINES))
def engine_class(request):
    return ENGINES[request.param]


@pytest.fixture(scope="module", autouse=True)
def prompt_ids(tiny_llama_tokenizer):
    PROMPT_IDS.update({key: tiny_llama_tokenizer.encode(text) for key, text in PROMPTS.items()})


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny_llama_dir, engine_class):
    engine = await engine_class.create(engine_config(tiny_llama_dir))
    yield engine
    await engine.shutdown()


@pytest_asyncio.fixture(loop_scope="module")
async def idle_engine(engine):
    """The module's engine; after the test, faults removed and checked idle with all its
    blocks free."""
    yield engine
    await call_in_core(engine, engine_hooks.remove_faults)
    await call_in_core(engine, engine_hooks.pace, None)
    assert engine.is_running
    assert engine.stats.num_running == engine.stats.num_waiting == 0
    assert engine.stats.num_free_blocks == engine.stats.num_total_blocks


async def run(engine, request_id: str, params: SamplingParams):
    prompt = PROMPT_IDS[request_id]
    outputs = [o async for o in engine.generate(request_id, prompt, params)]
    return [t for o in outputs for t in o.token_ids], outputs[-1]


async def run_batch(engine, ids, params):
    """The requests of ``ids`` started in one step: the engine is held while they arrive (a
    seeded request's tokens depend on the batch it starts in, in the last bits of its logits)."""
    held = call_in_core(engine, engine_hooks.pause, 0.3)
    results = await asyncio.gather(*(run(engine, i, params) for i in ids))
    await held
    return dict(zip(ids, results, strict=True))


async def test_cancelled_call_while_queued_for_the_engine_is_harmless(idle_engine):
    """A caller that gives up while its add_request waits behind a step must not kill the
    step loop, nor leave its request behind."""
    engine = idle_engine
    await call_in_core(engine, engine_hooks.pace, 0.2)
    busy = asyncio.create_task(run(engine, "a", GREEDY))
    await asyncio.sleep(0.3)  # the engine is inside a slow step now
    for _ in range(5):
        late = asyncio.create_task(run(engine, "b", GREEDY))
        await asyncio.sleep(0.01)  # its add_request is queued behind the step
        late.cancel()
        with pytest.raises(asyncio.CancelledError):
            await late
        await asyncio.sleep(0.25)  # the engine applies the queued command, then its abort
    await call_in_core(engine, engine_hooks.pace, None)
    tokens, last = await busy
    assert engine.is_running and last.num_output_tokens == 12
    assert (await run(engine, "c", GREEDY))[1].finish_reason is FinishReason.LENGTH


FAULTS = {
    # the batched sampler
    "logits_processors": "llmrpc.engine.sample.sampler:apply_logits_processors",
    "detokenizer": "output_processor.add_token",
    "stop_check": "scheduler._check_token_stop",
    "make_output": "output_processor.make_output",
}


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("where", list(FAULTS))
async def test_a_fault_in_one_request_ends_it_alone(idle_engine, where, params, caplog):
    engine = idle_engine
    clean = await run_batch(engine, ["a", "b", "c"], params)
    await call_in_core(engine, engine_hooks.fail_requests, FAULTS[where], "bad")
    with caplog.at_level(logging.ERROR):
        results = await run_batch(engine, ["a", "b", "bad", "c"], params)
    await call_in_core(engine, engine_hooks.remove_faults)
    _, last = results.pop("bad")
    assert last.finished and last.finish_reason is FinishReason.ERROR
    assert "injected fault for bad" in last.error
    assert {k: v[0] for k, v in results.items()} == {k: v[0] for k, v in clean.items()}
    assert engine.is_running
    assert (await run(engine, "c", params))[0] == clean["c"][0]
    # The engine's log line about it reaches this process's logging, whichever mode.
    assert any(
        re.search(r"\bbad\b", r.getMessage()) and r.name.startswith("llmrpc.engine")
        for r in caplog.records
    )


async def test_a_fault_in_prompt_logprobs_ends_that_request_alone(idle_engine):
    engine = idle_engine
    num_logits = len(PROMPT_IDS["bad"]) - 1
    await call_in_core(engine, engine_hooks.fail_prompt_logprobs, num_logits)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=1)
    good = asyncio.create_task(run(engine, "b", GREEDY))
    _, last = await run(engine, "bad", params)
    assert last.finish_reason is FinishReason.ERROR and "injected" in last.error
    assert (await good)[1].num_output_tokens == 12


async def test_a_failed_forward_pass_stops_the_engine(tiny_llama_dir, engine_class, caplog):
    engine = await engine_class.create(engine_config(tiny_llama_dir))
    try:
        causes = []
        engine.on_dead.append(causes.append)
        await call_in_core(engine, engine_hooks.break_forward_pass, "the device fell over")
        with pytest.raises(EngineDeadError, match="the device fell over"):
            await run(engine, "a", GREEDY)
        assert not engine.is_running
        assert [str(cause) for cause in causes] == ["the device fell over"]
        with pytest.raises(EngineDeadError, match="the device fell over"):
            await run(engine, "b", GREEDY)  # and every request after it
        assert any(r.getMessage() == "engine step loop died" for r in caplog.records)
    finally:
        await engine.shutdown()


async def test_stats_and_tokenizers_are_safe_to_use_while_the_engine_runs(
    idle_engine, tiny_llama_dir, tiny_llama_tokenizer
):
    """The event loop reads the engine's figures and the server's tokenizers tokenize while the
    engine steps and detokenizes: each thread has its own tokenizer (the server loads its own
    set, ``server/tokenization.py``, even with the engine core on a thread of its process), and
    the figures are a snapshot."""
    engine = idle_engine
    params = SamplingParams(temperature=0.7, max_tokens=40, ignore_eos=True)
    ids = [f"r{i}" for i in range(8)]
    PROMPT_IDS.update({i: tiny_llama_tokenizer.encode(f"Request {i} says hello") for i in ids})
    tokenization = await Tokenization.load(str(tiny_llama_dir))
    batch = asyncio.ensure_future(run_batch(engine, ids, params))
    text = "Tokenize me while the engine runs. " * 200
    reads = 0
    while not batch.done():
        stats = engine.stats
        assert 0.0 <= stats.kv_cache_usage <= 1.0 and stats.generation_throughput >= 0
        tokens = await tokenization.run(lambda tokenizer: tokenizer.encode(text))
        assert tokenization.tokenizer.decode(tokens[:5])
        reads += 1
    tokenization.shutdown()
    assert reads > 1
    assert all(last.num_output_tokens == 40 for _, last in (await batch).values())
