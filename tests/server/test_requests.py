"""Per-request behaviour of a configured server: the waiting-queue bound, request ids (echoed and
on every log line about the request), request/output/stats logging, --chat-template, sleep mode
off."""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import AsyncIterator

import grpc
import pytest
import pytest_asyncio
from engine_pace import restore_speed, slow_down
from google.rpc import error_details_pb2
from server_utils import field_violations, status_detail, tiny_engine_config, wait_until

from llmrpc.engine.config import SchedulerConfig
from llmrpc.engine.core_types import EngineStats, SpecDecodeCounts
from llmrpc.server.app import RunningServer, start_server
from llmrpc.server.interceptors import REQUEST_ID_METADATA
from llmrpc.server.logs import stats_line
from llmrpc.server.settings import FrontendConfig, LimitsConfig, LogConfig
from llmrpc.v1 import admin_pb2, common_pb2, generation_pb2, tokenization_pb2

pytestmark = pytest.mark.asyncio(loop_scope="module")

MAX_LOG_LEN = 12
CHAT_TEMPLATE = "{% for m in messages %}<<{{ m.content }}>>{% endfor %}"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(tiny_llama_dir) -> AsyncIterator[RunningServer]:
    """One request runs at a time, one more may wait; requests and outputs are logged."""
    engine_config = dataclasses.replace(
        tiny_engine_config(tiny_llama_dir), scheduler=SchedulerConfig(max_num_seqs=1)
    )
    frontend = FrontendConfig(
        host="127.0.0.1",
        grpc_port=0,
        chat_template=CHAT_TEMPLATE,
        limits=LimitsConfig(max_waiting_requests=1),
        logs=LogConfig(
            enable_log_requests=True,
            enable_log_outputs=True,
            max_log_len=MAX_LOG_LEN,
            stats_interval_s=0.05,
        ),
    )
    running = await start_server(engine_config, frontend=frontend)
    yield running
    await running.stop(grace=0)


def request(max_tokens: int = 4, **fields) -> generation_pb2.GenerateRequest:
    if "token_ids" not in fields:
        fields.setdefault("text", "Tell me a story about a dragon")
    return generation_pb2.GenerateRequest(
        sampling=common_pb2.SamplingParams(temperature=0.0),
        stopping=common_pb2.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True),
        **fields,
    )


async def test_a_full_waiting_queue_refuses_with_retry_info(generation, server):
    slow_down(server.engine, 0.02)
    try:
        running = generation.GenerateStream(request(max_tokens=200))
        await running.read()
        waiting = generation.GenerateStream(request(max_tokens=2))
        await wait_until(lambda: server.engine.stats.num_waiting == 1, what="a waiting request")
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            await generation.Generate(request())
        assert failure.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        retry = status_detail(failure.value, error_details_pb2.RetryInfo)
        assert retry.retry_delay.ToTimedelta().total_seconds() > 0
        running.cancel()
        assert [m async for m in waiting][-1].usage.completion_tokens == 2  # its place came
    finally:
        restore_speed(server.engine)
    assert (await generation.Generate(request())).usage.completion_tokens == 4


async def test_request_id_from_metadata_is_echoed_and_on_its_log_lines(generation, caplog):
    caplog.set_level(logging.INFO)
    call = generation.Generate(request(), metadata=((REQUEST_ID_METADATA, "trace-123"),))
    response = await call
    assert response.request_id == "trace-123"
    assert (REQUEST_ID_METADATA, "trace-123") in tuple(await call.initial_metadata())
    lines = [r for r in caplog.records if getattr(r, "request_id", None) == "trace-123"]
    messages = [r.getMessage() for r in lines]
    assert any(m.startswith("request: prompt 'Tell me a st',") for m in messages), messages
    assert any(m.startswith("output (length): ") for m in messages), messages
    assert all(r.request_tag == " [trace-123]" for r in lines)


async def test_token_id_input_is_logged_by_its_ids(generation, caplog):
    caplog.set_level(logging.INFO)
    ids = list(range(100, 120))
    metadata = ((REQUEST_ID_METADATA, "ids-1"),)
    await generation.Generate(request(token_ids=common_pb2.TokenIds(ids=ids)), metadata=metadata)
    line = next(r.getMessage() for r in caplog.records if r.request_id == "ids-1")
    assert line.startswith(f"request: prompt None, 20 prompt tokens {ids[:MAX_LOG_LEN]}, params ")


async def test_request_field_wins_and_an_id_is_made_otherwise(generation):
    own = generation.Generate(request(request_id="own-id"), metadata=((REQUEST_ID_METADATA, "x"),))
    assert (await own).request_id == "own-id"
    assert (REQUEST_ID_METADATA, "own-id") in tuple(await own.initial_metadata())
    made = generation.Generate(request())
    response = await made
    assert re.fullmatch(r"[0-9a-f]{32}", response.request_id)
    assert (REQUEST_ID_METADATA, response.request_id) in tuple(await made.initial_metadata())


async def test_request_id_is_echoed_on_errors_too(generation):
    call = generation.Generate(request(text=""), metadata=((REQUEST_ID_METADATA, "bad-1"),))
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        await call
    assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (REQUEST_ID_METADATA, "bad-1") in tuple(failure.value.initial_metadata())


async def test_streamed_output_is_logged_whole_once_cut_at_max_log_len(generation, caplog):
    caplog.set_level(logging.INFO)
    metadata = ((REQUEST_ID_METADATA, "stream-7"),)
    messages = [
        m async for m in generation.GenerateStream(request(max_tokens=20), metadata=metadata)
    ]
    tokens = [t for m in messages for t in m.token_ids]
    outputs = [
        r.getMessage()
        for r in caplog.records
        if r.request_id == "stream-7" and r.getMessage().startswith("output")
    ]
    assert outputs == [
        f"output (length): {''.join(m.text for m in messages)[:MAX_LOG_LEN]!r}, 20 tokens "
        f"{tokens[:MAX_LOG_LEN]}"
    ]


async def test_stats_line_is_logged_periodically(generation, caplog):
    caplog.set_level(logging.INFO, logger="llmrpc.stats")
    await generation.Generate(request(max_tokens=8))
    await wait_until(
        lambda: any("generation" in r.getMessage() for r in caplog.records), what="stats line"
    )
    line = next(r.getMessage() for r in caplog.records if "tokens/s" in r.getMessage())
    assert re.match(r"engine: \d+ running, \d+ waiting, KV cache [\d.]+% used, prefix", line)


async def test_stats_line_says_how_speculation_goes_where_it_speculates():
    idle = EngineStats(2, 0, 90, 100, 0.5, 10.0, 5.0, False)
    assert "drafts" not in stats_line(idle)
    no_drafts_yet = dataclasses.replace(idle, spec_decode=SpecDecodeCounts(0, 0, 0, (0, 0)))
    assert "drafts" not in stats_line(no_drafts_yet)
    speculating = dataclasses.replace(idle, spec_decode=SpecDecodeCounts(10, 40, 30, (9, 8)))
    assert stats_line(speculating).endswith(
        "generation 10.0 tokens/s, drafts accepted 75.0% (mean accepted length 4.00)"
    )


async def test_chat_template_flag_replaces_the_tokenizers(tokenization, server):
    chat = common_pb2.Chat(messages=[common_pb2.ChatMessage(role="user", content="hi")])
    response = await tokenization.Tokenize(tokenization_pb2.TokenizeRequest(chat=chat))
    assert server.tokenization.tokenizer.decode(response.token_ids) == "<<hi>>"


async def test_sleep_without_sleep_mode_is_failed_precondition(admin):
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        await admin.Sleep(admin_pb2.SleepRequest())
    assert failure.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "--enable-sleep-mode" in failure.value.details()


async def test_wake_up_without_sleep_mode_is_refused_as_sleep_is(admin):
    refusals = []
    calls = [(admin.Sleep, admin_pb2.SleepRequest()), (admin.WakeUp, admin_pb2.WakeUpRequest())]
    for call, message in calls:
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            await call(message)
        precondition = status_detail(failure.value, error_details_pb2.PreconditionFailure)
        refusals.append((failure.value.code(), failure.value.details(), precondition))
    assert refusals[0] == refusals[1]
    code, details, _ = refusals[1]
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "--enable-sleep-mode" in details
    # Never asleep, so IsSleeping answers (false) rather than refusing.
    assert not (await admin.IsSleeping(admin_pb2.IsSleepingRequest())).is_sleeping


async def test_prompt_longer_than_the_context_is_invalid_argument(generation):
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        await generation.Generate(request(text="word " * 600))  # the context is 512 tokens
    assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field_violations(failure.value) == ["text"]
