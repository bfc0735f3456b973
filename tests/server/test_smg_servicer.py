"""vLLM's engine service (``vllm.grpc.engine.VllmEngine``, as the smg router calls a worker) on the
server's own port, called with the stubs of our copy of the protocol: generation on token ids,
streamed and not, against the v1 API's own answers; its fields' errors; Abort and a client's
cancel; model, server and load facts; the tokenizer bundle; the prefix cache's events from a
real cache, flushed and resumed. tests/server/test_smg_router.py puts the smg router itself in
front of two servers."""

from __future__ import annotations

import asyncio
import hashlib
import io
import zipfile

import grpc
import pytest
import pytest_asyncio
from engine_pace import num_live_requests, restore_speed, slow_down
from server_utils import NUM_KV_BLOCKS, field_violations, frontend_config, read_rest, wait_until
from tokenizers import Tokenizer

from llmrpc.engine.config import CacheConfig, EngineConfig, ModelConfig
from llmrpc.server.app import start_server
from llmrpc.server.settings import FrontendConfig
from llmrpc.v1 import embedding_pb2, embedding_pb2_grpc, generation_pb2
from llmrpc.vllm_engine import common_pb2
from llmrpc.vllm_engine import vllm_engine_pb2 as pb
from llmrpc.vllm_engine import vllm_engine_pb2_grpc as pb_grpc

pytestmark = pytest.mark.asyncio(loop_scope="module")

BLOCK = 16  # the engine's default --block-size


def engine_config(model_dir, kv_events: dict | None) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model=str(model_dir), dtype="float32"),
        cache=CacheConfig(num_gpu_blocks_override=NUM_KV_BLOCKS, kv_events_config=kv_events),
    )


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(tiny_llama_dir):
    """The tiny model with the prefix cache's events on (a small buffer, to test resuming)."""
    events = {"enable_kv_cache_events": True, "buffer_steps": 20}
    running = await start_server(
        engine_config(tiny_llama_dir, events), frontend=frontend_config("thread")
    )
    yield running
    await running.stop(grace=0)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def vllm(channel) -> pb_grpc.VllmEngineStub:
    return pb_grpc.VllmEngineStub(channel)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_tokenizer):
    return tiny_llama_tokenizer


def request(ids, request_id="", stream=False, **sampling) -> pb.GenerateRequest:
    sampling.setdefault("temperature", 0.0)
    sampling.setdefault("max_tokens", 6)
    return pb.GenerateRequest(
        request_id=request_id,
        tokenized=pb.TokenizedInput(input_ids=ids),
        sampling_params=pb.SamplingParams(**sampling),
        stream=stream,
    )


async def responses(vllm, message) -> list[pb.GenerateResponse]:
    return [response async for response in vllm.Generate(message)]


async def test_unary_and_streamed_generation_match_the_v1_api(vllm, generation, tokenizer):
    ids = tokenizer.encode(
        "The capital of France is Paris, and the capital of Italy is Rome; the capital of Spain is"
    )
    assert len(ids) > BLOCK
    v1 = await generation.Generate(
        generation_pb2.GenerateRequest(
            token_ids={"ids": ids}, sampling={"temperature": 0.0}, stopping={"max_tokens": 6}
        )
    )
    (unary,) = await responses(vllm, request(ids, "unary-1"))
    done = unary.complete
    assert list(done.output_ids) == list(v1.token_ids)
    assert (done.finish_reason, done.prompt_tokens, done.completion_tokens) == (
        "length",
        len(ids),
        6,
    )
    streamed = await responses(vllm, request(ids, "stream-1", stream=True))
    chunks = [r.chunk for r in streamed if r.HasField("chunk")]
    assert [r.WhichOneof("response") for r in streamed][-1] == "complete"
    assert [t for c in chunks for t in c.token_ids] == list(v1.token_ids)
    assert sum(c.completion_tokens for c in chunks) == 6  # deltas, as vLLM's servicer sends
    last = streamed[-1].complete
    assert (last.finish_reason, last.completion_tokens) == ("length", 6)
    assert list(last.output_ids) == list(chunks[-1].token_ids)  # the last chunk's, repeated
    assert last.cached_tokens >= BLOCK  # the same prompt again: its full block from the cache


async def test_samples_logprobs_and_stops(vllm, tokenizer):
    ids = tokenizer.encode("Once upon a time")
    streamed = await responses(
        vllm, request(ids, stream=True, n=2, temperature=1.0, seed=-7, max_tokens=4)
    )
    completes = [r.complete for r in streamed if r.HasField("complete")]
    assert sorted(c.index for c in completes) == [0, 1]
    (done,) = await responses(vllm, request(ids, logprobs=2, prompt_logprobs=1))
    logprobs = done.complete.output_logprobs
    assert list(logprobs.token_ids) == list(done.complete.output_ids)
    assert all(len(top.token_ids) == 2 for top in logprobs.top_logprobs)
    prompt = done.complete.input_logprobs
    assert list(prompt.token_ids) == ids
    assert not prompt.token_logprobs[0].HasField("value")  # the first token has none
    assert all(entry.HasField("value") for entry in prompt.token_logprobs[1:])
    # A stop token: generation ends on it, and says so.
    first = done.complete.output_ids[1]
    (stopped,) = await responses(vllm, request(ids, stop_token_ids=[first], max_tokens=20))
    assert stopped.complete.finish_reason == "stop"
    assert stopped.complete.matched_token_id == first


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"temperature": -1.0}, "sampling_params.temperature"),
        ({"logprobs": -1}, "sampling_params.logprobs"),
        ({"top_p": 1.5}, "sampling_params.top_p"),
        ({"max_tokens": 10**6}, "sampling_params.max_tokens"),
        ({"logit_bias": {-3: 1.0}}, "sampling_params.logit_bias"),
        ({"n": 10**6}, "sampling_params.n"),
        ({"json_schema": "{not json"}, "sampling_params.json_schema"),
    ],
)
async def test_a_bad_sampling_field_is_invalid_argument_naming_it(vllm, tokenizer, change, field):
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await responses(vllm, request(tokenizer.encode("Hi"), **change))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field_violations(error.value) == [field]


async def test_what_is_not_served_is_refused_by_name(vllm, tokenizer, server):
    ids = tokenizer.encode("Hi")
    media = request(ids)
    media.mm_inputs.mm_hashes.append("abc")
    transfer = request(ids)
    transfer.kv_transfer_params_json = "{}"
    ranked = request(ids)
    ranked.data_parallel_rank = 1  # one engine here: rank 0 alone
    cases = [
        (pb.GenerateRequest(sampling_params=pb.SamplingParams()), "input"),
        (request([10**6]), "tokenized.input_ids"),
        (media, "mm_inputs"),
        (transfer, "kv_transfer_params_json"),
        (ranked, "data_parallel_rank"),
    ]
    for message, field in cases:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await responses(vllm, message)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, field
        assert field_violations(error.value) == [field]
    assert num_live_requests(server.engine) == 0


async def test_abort_by_request_id_and_a_client_cancel_end_the_engine_request(
    vllm, server, tokenizer
):
    slow_down(server.engine, 0.05)
    try:
        call = vllm.Generate(
            request(tokenizer.encode("Count"), "to-abort", stream=True, max_tokens=500)
        )
        first = await call.read()
        assert first.chunk.token_ids
        await vllm.Abort(pb.AbortRequest(request_ids=["to-abort", "no-such-request"]))
        rest = await read_rest(call)
        assert rest[-1].complete.finish_reason == "abort"
        assert rest[-1].complete.completion_tokens < 500
        await wait_until(lambda: num_live_requests(server.engine) == 0, what="the abort")
        call = vllm.Generate(
            request(tokenizer.encode("Count"), "to-cancel", stream=True, max_tokens=500)
        )
        await call.read()
        call.cancel()
        await wait_until(lambda: num_live_requests(server.engine) == 0, what="the cancel")
    finally:
        restore_speed(server.engine)


async def test_model_server_and_load_facts(vllm, server, tokenizer, tiny_llama_dir):
    prompt = list(range(40, 40 + 2 * BLOCK))  # twice: the second finds its blocks cached
    for _ in range(2):
        await responses(vllm, request(prompt, max_tokens=1))
    info = await vllm.GetModelInfo(pb.GetModelInfoRequest())
    model_info = server.engine.model_info
    assert info.served_model_name == model_info.served_model_names[0]
    assert info.is_generation and info.max_context_length == model_info.max_model_len
    assert info.tokenizer_path == str(tiny_llama_dir) and info.model_type == "llama"
    assert list(info.eos_token_ids) == sorted(model_info.eos_token_ids)
    assert info.vocab_size == model_info.vocab_size
    server_info = await vllm.GetServerInfo(pb.GetServerInfoRequest())
    assert (server_info.server_type, server_info.data_parallel_size) == ("llmrpc", 1)
    assert server_info.block_size == BLOCK and server_info.max_num_seqs == 256
    assert server_info.uptime_seconds > 0 and server_info.last_receive_timestamp > 0
    loads = await vllm.GetLoads(pb.GetLoadsRequest())
    assert loads.dp_rank_count == 1 and loads.version
    (load,) = loads.loads
    assert load.max_total_num_tokens == NUM_KV_BLOCKS * BLOCK
    assert load.num_running_reqs == 0 and 0 <= load.token_usage <= 1
    assert load.cache_hit_rate > 0
    health = await vllm.HealthCheck(pb.HealthCheckRequest())
    assert health.healthy


async def test_the_tokenizer_bundle_is_the_servers_tokenizer(vllm, tokenizer):
    pieces = [piece async for piece in vllm.GetTokenizer(common_pb2.GetTokenizerRequest())]
    assert all(not p.sha256 for p in pieces[:-1]) and pieces[-1].sha256
    archive = b"".join(p.data for p in pieces)
    assert hashlib.sha256(archive).hexdigest() == pieces[-1].sha256
    with zipfile.ZipFile(io.BytesIO(archive)) as bundle:
        names = set(bundle.namelist())
        assert {"tokenizer.json", "tokenizer_config.json", "config.json"} <= names
        rebuilt = Tokenizer.from_str(bundle.read("tokenizer.json").decode())
    text = "Shepherd routes tokens, 123 of them."
    assert rebuilt.encode(text, add_special_tokens=False).ids == tokenizer.encode(
        text, add_special_tokens=False
    )


async def next_batch(events) -> common_pb2.KvEventBatch:
    return await asyncio.wait_for(events.read(), timeout=10)


async def test_kv_events_come_from_the_prefix_cache(vllm, tokenizer):
    events = vllm.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest())
    await events.initial_metadata()
    ids = list(range(1000, 1000 + 2 * BLOCK + 5))  # two full blocks, and a partial one
    await responses(vllm, request(ids, max_tokens=2))
    batch = await next_batch(events)
    stored = [e.stored for e in batch.events if e.HasField("stored")]
    blocks = [b for s in stored for b in s.blocks]
    assert [list(b.token_ids) for b in blocks[:2]] == [ids[:BLOCK], ids[BLOCK : 2 * BLOCK]]
    assert all(b.block_size == BLOCK for b in blocks)
    assert not stored[0].HasField("parent_block_hash")  # the prompt's first block
    assert [e.event_id for e in batch.events] == list(range(1, len(batch.events) + 1))
    first_seq = batch.sequence_number
    # The same prompt again is served from the cache: no block of it is stored again.
    await responses(vllm, request(ids, max_tokens=1))
    flushed = await vllm.FlushCache(common_pb2.FlushCacheRequest(timeout_s=5))
    assert flushed.success
    later = [await next_batch(events)]
    while not any(e.HasField("cleared") for e in later[-1].events):
        later.append(await next_batch(events))
    again = [
        b for batch in later for e in batch.events if e.HasField("stored") for b in e.stored.blocks
    ]
    assert [list(b.token_ids) for b in again if b.token_ids[0] == ids[0]] == []
    numbers = [first_seq, *(b.sequence_number for b in later)]
    assert numbers == list(range(first_seq, first_seq + len(numbers)))  # no gaps
    events.cancel()
    # A subscriber that lost its stream resumes from a batch number: the same batches again.
    resumed = vllm.SubscribeKvEvents(
        common_pb2.SubscribeKvEventsRequest(start_sequence_number=first_seq)
    )
    assert await next_batch(resumed) == batch
    resumed.cancel()


async def test_kv_events_evictions_and_batch_numbers_out_of_reach(vllm, server, tokenizer):
    events = vllm.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest())
    await events.initial_metadata()
    # More distinct full blocks than the cache holds: the oldest are evicted (removed).
    prompt_blocks = 8
    for n in range(NUM_KV_BLOCKS // prompt_blocks + 2):
        start = 2000 + n * prompt_blocks * BLOCK
        await responses(
            vllm, request(list(range(start, start + prompt_blocks * BLOCK + 1)), max_tokens=1)
        )
    stored, removed = set(), []
    while len(removed) < 2 * prompt_blocks:
        for event in (await next_batch(events)).events:
            if event.HasField("stored"):
                stored.update(b.block_hash for b in event.stored.blocks)
            elif event.HasField("removed"):
                removed.extend(event.removed.block_hashes)
    assert set(removed[:prompt_blocks]) <= stored
    events.cancel()
    for start in (1, 2**62):  # out of the buffer of 20; ahead of this server's numbering
        with pytest.raises(grpc.aio.AioRpcError) as error:
            call = vllm.SubscribeKvEvents(
                common_pb2.SubscribeKvEventsRequest(start_sequence_number=start)
            )
            await call.read()
        assert error.value.code() == grpc.StatusCode.OUT_OF_RANGE


async def test_a_server_without_events_and_with_keys(tiny_llama_dir, tokenizer):
    """KV events off: UNIMPLEMENTED, as vLLM answers (the router then stops asking). API keys:
    a generation key generates; FlushCache takes the admin key."""
    frontend = FrontendConfig(
        host="127.0.0.1",
        grpc_port=0,
        disable_frontend_multiprocessing=True,
        api_key=("gen-key",),
        admin_api_key=("admin-key",),
    )
    running = await start_server(engine_config(tiny_llama_dir, None), frontend=frontend)
    try:
        async with grpc.aio.insecure_channel(running.address) as channel:
            vllm = pb_grpc.VllmEngineStub(channel)
            key = (("authorization", "Bearer gen-key"),)
            admin = (("authorization", "Bearer admin-key"),)
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await vllm.GetModelInfo(pb.GetModelInfoRequest())
            assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
            (done,) = [
                r async for r in vllm.Generate(request(tokenizer.encode("Hi")), metadata=key)
            ]
            assert done.complete.completion_tokens == 6
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await vllm.FlushCache(common_pb2.FlushCacheRequest(), metadata=key)
            assert error.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert (await vllm.FlushCache(common_pb2.FlushCacheRequest(), metadata=admin)).success
            with pytest.raises(grpc.aio.AioRpcError) as error:
                call = vllm.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(), metadata=key)
                await call.read()
            assert error.value.code() == grpc.StatusCode.UNIMPLEMENTED
            assert "--kv-events-config" in error.value.details()
    finally:
        await running.stop(grace=0)


async def test_embed_is_the_embedding_services_vector(vllm, channel, tokenizer):
    ids = tokenizer.encode("Shepherds route sheep.")
    answer = await vllm.Embed(
        pb.EmbedRequest(request_id="e-1", tokenized=pb.TokenizedInput(input_ids=ids))
    )
    v1 = await embedding_pb2_grpc.EmbeddingServiceStub(channel).Embed(
        embedding_pb2.EmbedRequest(inputs=[{"token_ids": {"ids": ids}}])
    )
    assert list(answer.embedding) == list(v1.results[0].embedding) and answer.embedding
    assert (answer.prompt_tokens, answer.embedding_dim) == (len(ids), len(answer.embedding))
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await vllm.Embed(pb.EmbedRequest(tokenized=pb.TokenizedInput(input_ids=[10**6])))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field_violations(error.value) == ["tokenized.input_ids"]
