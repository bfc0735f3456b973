"""``vllm.grpc.engine.VllmEngine``: vLLM's engine service as the smg router (PyPI ``smg``) calls a
gRPC worker, served beside the v1 services on the same port.

The router tokenizes (its tokenizer comes from GetModelInfo's ``tokenizer_path``, or from
GetTokenizer), sends token ids to Generate, detokenizes what comes back and renders the OpenAI
responses itself. Each Generate runs as a v1 ``GenerateRequest`` through ``GenerationServicer``
(``vllm_engine_convert`` builds it), so admission, the auth and request-id interceptors,
cancellation (a cancelled call aborts the engine request; so does Abort with the request's
``request_id``), metrics and logs are the v1 API's; errors are gRPC statuses with ``google.rpc``
details naming this service's fields.

A stream sends each sample's new tokens as a chunk, then, when the sample ends, a Complete
holding its last chunk's tokens again (as vLLM's servicer does) and the sample's counts; without
``stream`` each sample gets one Complete with all its tokens. GetLoads reports the engine's
figures per data-parallel rank. With ``--kv-events-config '{"enable_kv_cache_events": true}'``
SubscribeKvEvents streams the prefix cache's changes (``engine/client/kv_events.py``); without
it the call is UNIMPLEMENTED, as vLLM answers, and the router falls back to its own estimate.
StartProfile and StopProfile are UNIMPLEMENTED: there is no profiler.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import hashlib
import io
import json
import logging
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

from llmrpc.engine.client.data_parallel import pinned_rank
from llmrpc.engine.client.kv_events import KVEventsEnded, ReplayUnavailable, SubscriberBehind
from llmrpc.server import admin
from llmrpc.server.embedding import EmbeddingServicer
from llmrpc.server.errors import (
    DataLoss,
    FailedPrecondition,
    InvalidArgument,
    OutOfRange,
    Unavailable,
    Unimplemented,
    handle_errors,
)
from llmrpc.server.logs import current_request_id
from llmrpc.server.servicers import GenerationServicer
from llmrpc.server.state import ServerState, server_version
from llmrpc.server.vllm_engine_convert import (
    chunk,
    complete,
    event_batch,
    in_request_terms,
    v1_request,
)
from llmrpc.v1 import embedding_pb2
from llmrpc.vllm_engine import common_pb2
from llmrpc.vllm_engine import vllm_engine_pb2 as pb
from llmrpc.vllm_engine import vllm_engine_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["VllmEngine"].full_name
SERVER_TYPE = "llmrpc"
TOKENIZER_CHUNK_BYTES = 64 * 1024
# The files of a tokenizer folder the router builds its tokenizer from (and the model's config),
# by name and by pattern.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "tiktoken.model",
    "chat_template.json",
    "config.json",
    "generation_config.json",
    "preprocessor_config.json",
)
TOKENIZER_PATTERNS = ("*.jinja", "*.tiktoken", "*.model")
# The generation config's defaults the router applies to requests that leave them unset.
_SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
FLUSH_POLL_S = 0.05


class VllmEngineServicer(pb_grpc.VllmEngineServicer):
    def __init__(
        self,
        state: ServerState,
        generation: GenerationServicer,
        embedding: EmbeddingServicer,
        health,
    ) -> None:
        self.state = state
        self.generation = generation
        self.embedding = embedding
        self.health = health  # server.health.Health
        self.started_at = time.monotonic()
        self.last_receive_timestamp = 0.0  # time.time() of the last Generate or Embed
        # the tokenizer folder zipped, and its SHA-256, made by the first GetTokenizer
        self._tokenizer_archive: asyncio.Task[tuple[bytes, str]] | None = None

    # --- generation --------------------------------------------------------------------------

    @handle_errors
    async def Generate(self, request, context):
        self.last_receive_timestamp = time.time()
        engine = self.state.require_engine()
        if request.HasField("data_parallel_rank"):
            self._check_rank(engine, request.data_parallel_rank, "data_parallel_rank")
            if _ranks(engine) > 1:
                pinned_rank.set(request.data_parallel_rank)  # this call's task alone
        with in_request_terms():
            v1 = v1_request(request, engine.model_info)
            if request.stream:
                await self._stream(v1, context)
            else:
                await self._unary(v1, context)

    async def _stream(self, v1, context) -> None:
        seen: set[int] = set()  # samples that have sent their first chunk

        async def send(prompt: list[int], delta) -> None:
            first = delta.index not in seen
            seen.add(delta.index)
            first_token = _first_token(prompt, delta.num_prompt_tokens)
            await context.write(chunk(delta, first_token, with_prompt_logprobs=first))
            if delta.finished:
                await context.write(complete(delta, first_token, None))

        await self.generation._generate(v1, context, on_output=send)

    async def _unary(self, v1, context) -> None:
        prompts: list[list[int]] = []

        async def keep_prompt(prompt: list[int], delta) -> None:
            if not prompts:
                prompts.append(prompt)

        outputs, _ = await self.generation._generate(v1, context, on_output=keep_prompt)
        for index in sorted(outputs.samples):
            sample = outputs.samples[index]
            first_token = _first_token(prompts[0], sample.num_prompt_tokens) if prompts else None
            await context.write(complete(sample, first_token, sample.prompt_logprobs))

    @handle_errors
    async def Embed(self, request, context):
        self.last_receive_timestamp = time.time()
        if not request.HasField("tokenized"):
            raise InvalidArgument("tokenized", "set the input's token ids")
        v1 = embedding_pb2.EmbedRequest()
        v1.inputs.add().token_ids.ids.extend(request.tokenized.input_ids)
        response = await self.embedding._embed(v1, context)
        (result,) = response.results
        if result.HasField("error"):
            field = result.error.message.partition(":")[0]
            message = result.error.message.removeprefix(f"{field}: ")
            raise InvalidArgument("tokenized.input_ids", message)
        return pb.EmbedResponse(
            embedding=result.embedding,
            prompt_tokens=result.num_prompt_tokens,
            embedding_dim=len(result.embedding),
        )

    @handle_errors
    async def Abort(self, request, context):
        """Abort the live requests among ``request_ids`` that this caller may abort (an admin
        key's, any; others, those their own key started); the rest are ignored, as vLLM does."""
        request_ids = admin.abortable(self.state, list(request.request_ids), "request_ids")
        aborted = await self.state.require_engine().abort(request_ids)
        if aborted:
            logger.info("aborted %d request(s): %s", len(aborted), ", ".join(aborted))
        return pb.AbortResponse()

    # --- facts and figures -------------------------------------------------------------------

    @handle_errors
    async def HealthCheck(self, request, context):
        """Healthy while the server reports SERVING (the model loaded, the engine alive and not
        stalled, the server not stopping); the message says why not."""
        engine = self.state.engine
        if engine is None:
            return pb.HealthCheckResponse(healthy=False, message="the model is still loading")
        if engine.dead_error is not None:
            message = f"the engine has stopped: {engine.dead_error}"
            return pb.HealthCheckResponse(healthy=False, message=message)
        if not self.health.serving:
            message = "not serving (the engine is stalled, or the server is stopping)"
            return pb.HealthCheckResponse(healthy=False, message=message)
        return pb.HealthCheckResponse(healthy=True, message="serving")

    @handle_errors
    async def GetModelInfo(self, request, context):
        engine = self.state.require_engine()
        info = engine.model_info
        config = _model_config(info.model_dir)
        tokenizer = self.state.tokenization.tokenizer if self.state.tokenization else None
        served = info.served_model_names[0]
        hide = self.state.hide_model_path
        tokenizer_path = self.state.tokenizer_path or ""
        defaults = {
            key: info.sampling_defaults[key]
            for key in _SAMPLING_DEFAULT_KEYS
            if info.sampling_defaults.get(key) is not None
        }
        pad = getattr(tokenizer, "pad_token_id", None)
        if pad is None:
            pad = config.get("pad_token_id")
        return pb.GetModelInfoResponse(
            model_path=served if hide else info.model_dir,
            is_generation=info.runner == "generate",
            max_context_length=info.max_model_len,
            vocab_size=info.vocab_size,
            supports_vision=False,
            served_model_name=served,
            tokenizer_path=served if hide else tokenizer_path,
            model_type=config.get("model_type") or "",
            architectures=config.get("architectures") or [],
            eos_token_ids=sorted(info.eos_token_ids),
            pad_token_id=pad if isinstance(pad, int) else 0,
            bos_token_id=info.bos_token_id or 0,
            max_req_input_len=info.max_model_len,
            default_sampling_params_json=json.dumps(defaults, separators=(",", ":"))
            if defaults
            else "",
        )

    @handle_errors
    async def GetServerInfo(self, request, context):
        engine = self.state.require_engine()
        config = self.state.effective_config
        info = engine.model_info
        return pb.GetServerInfoResponse(
            active_requests=engine.num_requests_in_flight,
            is_paused=engine.is_sleeping,
            last_receive_timestamp=self.last_receive_timestamp,
            uptime_seconds=time.monotonic() - self.started_at,
            server_type=SERVER_TYPE,
            data_parallel_size=_ranks(engine),
            kv_cache_dtype=config.get("kv_cache_dtype", ""),
            block_size=info.block_size,
            model_dtype=f"torch.{info.dtype}",
            max_num_seqs=int(config.get("max_num_seqs") or 0),
        )

    @handle_errors
    async def GetLoads(self, request, context):
        engine = self.state.require_engine()
        per_rank = list(getattr(engine, "engine_stats", None) or [engine.stats])
        ranks = range(len(per_rank))
        if request.HasField("dp_rank"):
            self._check_rank(engine, request.dp_rank, "dp_rank")
            ranks = [request.dp_rank]
        block_size = engine.model_info.block_size
        max_running = int(self.state.effective_config.get("max_num_seqs") or 0)
        loads = []
        for rank in ranks:
            stats = per_rank[rank]
            used = stats.num_total_blocks - stats.num_free_blocks
            loads.append(
                pb.SchedulerLoad(
                    dp_rank=rank,
                    num_running_reqs=stats.num_running,
                    num_waiting_reqs=stats.num_waiting,
                    num_total_reqs=stats.num_running + stats.num_waiting,
                    num_used_tokens=used * block_size,
                    max_total_num_tokens=stats.num_total_blocks * block_size,
                    token_usage=stats.kv_cache_usage,
                    gen_throughput=stats.generation_throughput,
                    cache_hit_rate=stats.prefix_cache_hit_rate,
                    max_running_requests=max_running,
                )
            )
        now = datetime.datetime.now(datetime.timezone.utc)
        return pb.GetLoadsResponse(
            timestamp=now.isoformat(),
            version=server_version(),
            dp_rank_count=len(per_rank),
            loads=loads,
        )

    @handle_errors
    async def GetTokenizer(self, request, context):
        """The tokenizer folder's files the server loaded, zipped, in 64 KiB pieces; the last
        one carries the archive's SHA-256."""
        self.state.require_engine()
        path = self.state.tokenizer_path
        if path is None:
            raise FailedPrecondition(
                "tokenizer", "this server runs with --skip-tokenizer-init and has no tokenizer"
            )
        if self._tokenizer_archive is None:  # zipped once: every router asks for the same files
            self._tokenizer_archive = asyncio.ensure_future(
                asyncio.to_thread(_zipped_tokenizer, Path(path))
            )
        try:
            archive, digest = await asyncio.shield(self._tokenizer_archive)
        except OSError:
            self._tokenizer_archive = None  # the next call tries again
            raise
        for start in range(0, len(archive), TOKENIZER_CHUNK_BYTES):
            end = start + TOKENIZER_CHUNK_BYTES
            last = end >= len(archive)
            piece = common_pb2.GetTokenizerChunk(
                data=archive[start:end], sha256=digest if last else ""
            )
            await context.write(piece)

    # --- the prefix cache --------------------------------------------------------------------

    @handle_errors
    async def FlushCache(self, request, context):
        """Forget the prefix cache; while requests hold blocks, wait up to ``timeout_s`` for
        them to end (0: answer at once). ``success`` false says they did not."""
        engine = self.state.require_engine()
        deadline = time.monotonic() + max(request.timeout_s, 0.0)
        while not await engine.reset_prefix_cache():
            if time.monotonic() >= deadline:
                return common_pb2.FlushCacheResponse(
                    success=False,
                    message="requests hold KV cache blocks; retry once they finish, or give "
                    "timeout_s to wait for them",
                )
            await asyncio.sleep(FLUSH_POLL_S)
        logger.info("prefix cache flushed")
        return common_pb2.FlushCacheResponse(success=True, message="prefix cache flushed")

    @handle_errors
    async def SubscribeKvEvents(self, request, context):
        engine = self.state.require_engine()
        log = getattr(engine, "kv_event_log", None)
        if log is None:
            raise Unimplemented(
                "KV cache events are off: start the server with --kv-events-config "
                "'{\"enable_kv_cache_events\": true}'"
            )
        if self.health.stopping.is_set():
            raise Unavailable("the server is stopping")
        stopping = asyncio.ensure_future(self.health.stopping.wait())
        reading: asyncio.Future | None = None
        next_event_id = 1
        try:
            with _subscription_errors(), log.subscribe(request.start_sequence_number) as events:
                logger.info(
                    "KV events: %s subscribed from batch %d",
                    current_request_id(),
                    request.start_sequence_number,
                )
                while True:
                    reading = asyncio.ensure_future(events.next_batches())
                    await asyncio.wait((reading, stopping), return_when=asyncio.FIRST_COMPLETED)
                    if not reading.done():  # the server is stopping: the stream ends (OK)
                        return
                    for batch in reading.result():
                        await context.write(event_batch(batch, next_event_id))
                        next_event_id += len(batch.events)
        finally:  # the call ended, was cancelled, or the server stops
            for waiting in (stopping, reading):
                if waiting is not None:
                    waiting.cancel()

    # --- helpers -----------------------------------------------------------------------------

    def _check_rank(self, engine, rank: int, field: str) -> None:
        count = _ranks(engine)
        if not 0 <= rank < count:
            raise InvalidArgument(
                field, f"must be in [0, {count}) (--data-parallel-size), got {rank}"
            )

    @handle_errors
    async def StartProfile(self, request, context):
        raise Unimplemented("this server has no profiler")

    @handle_errors
    async def StopProfile(self, request, context):
        raise Unimplemented("this server has no profiler")


def _ranks(engine) -> int:
    """The engine's data-parallel size (1 for a single engine)."""
    return len(getattr(engine, "engines", None) or [engine])


def _first_token(prompt: list[int], num_prompt_tokens: int) -> int | None:
    """The first token of the prompt the engine ran (its last ``num_prompt_tokens``)."""
    if not prompt or num_prompt_tokens <= 0:
        return None
    return prompt[max(len(prompt) - num_prompt_tokens, 0)]


def _model_config(model_dir: str) -> dict:
    """The model folder's config.json ({} where there is none to read)."""
    try:
        return json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def _zipped_tokenizer(folder: Path) -> tuple[bytes, str]:
    """The folder zipped, and the archive's SHA-256 (hex)."""
    archive = _zip_tokenizer(folder)
    return archive, hashlib.sha256(archive).hexdigest()


def _zip_tokenizer(folder: Path) -> bytes:
    if not folder.is_dir():
        raise FailedPrecondition(
            "tokenizer", f"the tokenizer was not loaded from a folder: {folder}"
        )
    names = [name for name in TOKENIZER_FILES if (folder / name).is_file()]
    for pattern in TOKENIZER_PATTERNS:
        names += sorted(p.name for p in folder.glob(pattern) if p.is_file() and p.name not in names)
    if not names:
        raise FailedPrecondition("tokenizer", f"no tokenizer files in {folder}")
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name in names:
            archive.write(folder / name, name)
    return buffer.getvalue()


@contextlib.contextmanager
def _subscription_errors() -> Iterator[None]:
    """The event log's refusals as statuses: OUT_OF_RANGE for a batch number it cannot resume
    from, DATA_LOSS for a subscriber that fell behind (the smg router then starts again from
    0), UNAVAILABLE once the engine has stopped."""
    try:
        yield
    except ReplayUnavailable as error:
        raise OutOfRange(f"start_sequence_number: {error}") from None
    except SubscriberBehind as error:
        raise DataLoss(f"this subscriber {error}; subscribe again from 0") from None
    except KVEventsEnded as error:
        raise Unavailable(f"the engine has stopped: {error}") from None
