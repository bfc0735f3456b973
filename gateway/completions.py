"""``POST /v1/completions``: one gRPC generation per prompt, ``n`` samples each.

Prompts come as a string, a list of strings, token ids, or a list of token-id lists; choice
``i * n + j`` is sample ``j`` of prompt ``i``. ``echo`` puts the prompt's text before each
choice's (and, with ``logprobs``, the prompt's logprobs before the output's; the first prompt
token has none).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import APIRouter, Request

from llmrpc.clients import Delta, LlmrpcError, Sample, TokenLogprob, Usage
from llmrpc.clients.connection import in_batch
from llmrpc.common.aio import gather_or_cancel
from llmrpc.gateway import fanout, responses
from llmrpc.gateway.errors import from_grpc, invalid
from llmrpc.gateway.json_body import JsonRoute
from llmrpc.gateway.metrics import RequestTimer
from llmrpc.gateway.openai_models import CompletionRequest
from llmrpc.gateway.openapi_docs import ERRORS, Completion, generation
from llmrpc.gateway.param_names import COMPLETION_PARAMS
from llmrpc.gateway.params import completion_params
from llmrpc.gateway.sse import DONE, ChunkFramer, first_then_rest, until_disconnect
from llmrpc.gateway.state import GatewayState, gateway_of, request_id
from llmrpc.v1.headers import BATCH_SEQUENCES

router = APIRouter(route_class=JsonRoute, responses=ERRORS)

Prompt = str | list[int]


@router.post("/v1/completions", responses=generation(Completion))
async def create_completion(body: CompletionRequest, request: Request):
    gateway = gateway_of(request)
    model = await until_disconnect(request, gateway.model_name(body.model))
    call = CompletionCall(gateway, body, request_id(request), model)
    names = {**param_names(body), **call.param_names, BATCH_SEQUENCES: "prompt"}
    if body.stream:
        return await first_then_rest(request, call.chunks(), names)
    try:
        return await until_disconnect(request, call.complete())
    except LlmrpcError as error:
        raise from_grpc(error, names) from None


def param_names(body: CompletionRequest) -> dict[str, str | None]:
    """gRPC field paths -> this request's parameters: prompt logprobs come from
    ``prompt_logprobs`` when given, else from ``logprobs`` (echo)."""
    if body.prompt_logprobs is None:
        return COMPLETION_PARAMS
    return {**COMPLETION_PARAMS, "output.prompt_logprobs": "prompt_logprobs"}


def _prompts(prompt) -> list[Prompt]:
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    if not prompt or any(len(p) == 0 for p in prompt):
        raise invalid("prompt", "prompts must not be empty")
    return list(prompt)


@dataclass
class Echo:
    text: str
    first_token: tuple[int, str] | None  # (id, text) of the prompt's first token, for logprobs


class CompletionCall:
    def __init__(self, gateway: GatewayState, body: CompletionRequest, rid: str, model: str):
        self.gateway = gateway
        self.pool = gateway.pool
        self.body = body
        self.params, self.param_names = completion_params(body)
        self.prompts = _prompts(body.prompt)
        fanout.check_prompts(gateway.api, len(self.prompts), "prompt")
        fanout.check_sequences(gateway.api, len(self.prompts), body.n, "prompt")
        self.request_id = rid
        self.model = model
        target = gateway.grpc_model(body.model)
        self.grpc_model = target.pop("model")
        self.params.update(target)  # lora, when body.model names an adapter
        as_ids = gateway.api.return_tokens_as_token_ids or bool(body.return_tokens_as_token_ids)
        self.names = responses.TokenNames(as_ids)
        self.timer = RequestTimer(gateway.metrics)
        self.created = int(time.time())

    def _grpc_id(self, index: int) -> str:
        return self.request_id if len(self.prompts) == 1 else f"{self.request_id}-{index}"

    async def _echo(self, prompt: Prompt) -> Echo | None:
        if not self.body.echo:
            return None
        text = prompt
        if not isinstance(prompt, str):
            text = await self.pool.call("detokenize", prompt, model=self.grpc_model)
        first = await self._first_token(prompt) if self.body.logprobs is not None else None
        return Echo(text, first)

    async def _first_token(self, prompt: Prompt) -> tuple[int, str]:
        ids = prompt
        if isinstance(prompt, str):
            add_special = self.body.add_special_tokens
            tokens = await self.pool.call(
                "tokenize", prompt, model=self.grpc_model, add_special_tokens=add_special
            )
            ids = tokens.token_ids
        text = await self.pool.call(
            "detokenize", ids[:1], model=self.grpc_model, skip_special_tokens=False
        )
        return ids[0], text

    def _logprobs(self, echo: Echo | None, prompt_lps: list[TokenLogprob], lps: list[TokenLogprob]):
        if self.body.logprobs is None:
            return None
        body = responses.CompletionLogprobs(self.names)
        if echo is not None and echo.first_token is not None:
            body.add_unscored(*echo.first_token)
            body.add(prompt_lps)
        return body.add(lps).body

    def _finish(self, usages: list[Usage], reasons: list[str]) -> None:
        prompt = sum(u.prompt_tokens for u in usages)
        self.timer.finish(prompt, sum(u.completion_tokens for u in usages), reasons)

    def _usage(self, usages: list[Usage]) -> dict:
        return responses.usage(usages, self.gateway.api.enable_prompt_tokens_details)

    # --- whole responses ------------------------------------------------------------------

    def _batch(self):
        """Several prompts are several calls: each says it is part of this request, so the
        server admits the request's sequences to its queue whole."""
        if len(self.prompts) == 1:
            return contextlib.nullcontext()
        return in_batch(self.request_id, len(self.prompts) * self.body.n)

    async def complete(self) -> dict:
        with self._batch():
            parts = (self._one(i, p) for i, p in enumerate(self.prompts))
            results = await gather_or_cancel(*parts)
        choices = [choice for choices, _ in results for choice in choices]
        usages = [u for _, u in results]
        self.timer.tokens_arrived()
        self._finish(usages, [c["finish_reason"] for c in choices])
        return {
            "id": f"cmpl-{self.request_id}",
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self._usage(usages),
        }

    async def _one(self, index: int, prompt: Prompt) -> tuple[list[dict], Usage]:
        echo = await self._echo(prompt)
        completion = await self.pool.call(
            "generate",
            prompt,
            model=self.grpc_model,
            request_id=self._grpc_id(index),
            **self.params,
        )
        choices = [
            self._choice(index, sample, echo, completion.prompt_logprobs)
            for sample in completion.samples
        ]
        return choices, completion.usage

    def _choice(self, index: int, sample: Sample, echo: Echo | None, prompt_lps) -> dict:
        choice = {
            "index": index * self.body.n + sample.index,
            "text": (echo.text if echo else "") + sample.text,
            "logprobs": self._logprobs(echo, prompt_lps, sample.logprobs),
            "finish_reason": responses.finish_reason(sample.finish_reason),
            "stop_reason": responses.stop_reason(sample.finish_reason, sample.matched_stop),
        }
        if self.body.prompt_logprobs is not None:
            choice["prompt_logprobs"] = responses.prompt_logprobs(prompt_lps, self.names)
        return choice

    # --- streams --------------------------------------------------------------------------

    async def chunks(self) -> AsyncIterator[bytes]:
        """The SSE chunks: each delta as it comes, then usage if asked for, then [DONE]."""
        api = self.gateway.api
        options = self.body.stream_options
        with_usage = api.enable_force_include_usage or bool(options and options.include_usage)
        framer = ChunkFramer(
            f"cmpl-{self.request_id}", "text_completion", self.created, self.model, with_usage
        )
        echoes = [await self._echo(p) for p in self.prompts]
        stream = _StreamState(self, echoes)
        async for prompt_index, delta in self._deltas():
            yield framer.choice(stream.choice(prompt_index, delta))
        if with_usage:
            yield framer.usage(self._usage(stream.usages))
        yield DONE
        self._finish(stream.usages, stream.reasons)

    def _stream(self, index: int, prompt: Prompt) -> AsyncIterator[Delta]:
        rid = self._grpc_id(index)
        return self.pool.stream(
            "stream", prompt, model=self.grpc_model, request_id=rid, **self.params
        )

    async def _deltas(self) -> AsyncIterator[tuple[int, Delta]]:
        if len(self.prompts) == 1:
            async for delta in self._stream(0, self.prompts[0]):
                yield 0, delta
            return
        streams = [self._stream(i, p) for i, p in enumerate(self.prompts)]
        async for item in merge_streams(streams, self._batch()):
            yield item


class _StreamState:
    """Per-choice state of a streamed completion: echo sent yet, logprob text offsets."""

    def __init__(self, call: CompletionCall, echoes: list[Echo | None]) -> None:
        self.call = call
        self.echoes = echoes
        self.offsets: dict[int, int] = {}  # choice index -> text length sent so far
        self.prompt_logprobs: dict[int, list[TokenLogprob]] = {}  # on each stream's first delta
        self.usages: list[Usage] = []
        self.reasons: list[str] = []

    def choice(self, prompt_index: int, delta: Delta) -> dict:
        call = self.call
        index = prompt_index * call.body.n + delta.index
        if delta.token_ids:
            call.timer.tokens_arrived()
        if delta.prompt_logprobs:
            self.prompt_logprobs[prompt_index] = delta.prompt_logprobs
        text, logprobs = delta.text, None
        first = index not in self.offsets
        echo = self.echoes[prompt_index] if first else None
        if echo is not None:
            text = echo.text + text
        if call.body.logprobs is not None:
            logprobs = self._logprobs(index, echo, self.prompt_logprobs.get(prompt_index), delta)
        self.offsets[index] = self.offsets.get(index, 0) + len(text)
        reason = responses.finish_reason(delta.finish_reason)
        if reason is not None:
            self.reasons.append(reason)
        if delta.usage is not None:
            self.usages.append(delta.usage)
        return {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": reason,
            "stop_reason": responses.stop_reason(delta.finish_reason, delta.matched_stop),
        }

    def _logprobs(self, index: int, echo: Echo | None, prompt_lps, delta: Delta) -> dict:
        body = responses.CompletionLogprobs(self.call.names, self.offsets.get(index, 0))
        if echo is not None and echo.first_token is not None:
            body.add_unscored(*echo.first_token)
            body.add(prompt_lps or [])
        return body.add(delta.logprobs).body


async def merge_streams(
    streams: list[AsyncIterator[Delta]], scope=None
) -> AsyncIterator[tuple[int, Delta]]:
    """The deltas of several streams as they arrive, tagged with the stream's index; the first
    error ends them all. The streams' calls are made inside the context manager ``scope``."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[Delta]) -> None:
        try:
            async for delta in stream:
                await queue.put((index, delta))
            await queue.put((index, None))
        except Exception as error:  # noqa: BLE001 - re-raised by the consumer below
            await queue.put((index, error))

    with scope or contextlib.nullcontext():  # each task starts in a copy of this context
        tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            if item is None:
                remaining -= 1
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
