"""``POST /v1/chat/completions``: the messages go to the gRPC API as chat input, rendered with
the chat template on the replica (``add_generation_prompt``, ``continue_final_message``,
``chat_template``, ``chat_template_kwargs`` travel with them).

A stream opens, once the replica has answered, with a chunk per choice carrying the role;
then content deltas; each choice's last chunk has its ``finish_reason``.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request

from llmrpc.clients import Completion, Delta, LlmrpcError, Usage
from llmrpc.gateway import params, responses
from llmrpc.gateway.errors import from_grpc
from llmrpc.gateway.json_body import JsonRoute
from llmrpc.gateway.metrics import RequestTimer
from llmrpc.gateway.openai_models import ChatCompletionRequest
from llmrpc.gateway.openapi_docs import ERRORS, ChatCompletion, generation
from llmrpc.gateway.param_names import CHAT_PARAMS
from llmrpc.gateway.sse import DONE, ChunkFramer, first_then_rest, until_disconnect
from llmrpc.gateway.state import GatewayState, gateway_of, request_id

router = APIRouter(route_class=JsonRoute, responses=ERRORS)


def param_names(body: ChatCompletionRequest) -> dict[str, str | None]:
    """gRPC field paths -> this request's parameters: max_tokens is max_completion_tokens when
    the caller used that name."""
    if body.max_completion_tokens is None:
        return CHAT_PARAMS
    return {**CHAT_PARAMS, "stopping.max_tokens": "max_completion_tokens"}


@router.post("/v1/chat/completions", responses=generation(ChatCompletion))
async def create_chat_completion(body: ChatCompletionRequest, request: Request):
    gateway = gateway_of(request)
    model = await until_disconnect(request, gateway.model_name(body.model))
    call = ChatCall(gateway, body, request_id(request), model)
    names = param_names(body)
    if body.stream:
        return await first_then_rest(request, call.chunks(), names)
    try:
        return await until_disconnect(request, call.complete())
    except LlmrpcError as error:
        raise from_grpc(error, names) from None


class ChatCall:
    def __init__(self, gateway: GatewayState, body: ChatCompletionRequest, rid: str, model: str):
        api = gateway.api
        self.gateway = gateway
        self.body = body
        self.request_id = rid
        self.model = model
        self.messages = params.chat_messages(body.messages)
        self.options = params.chat_options(body, api)
        self.params = params.chat_params(body)
        self.role = params.response_role(body, api)
        as_ids = api.return_tokens_as_token_ids or bool(body.return_tokens_as_token_ids)
        self.names = responses.TokenNames(as_ids)
        self.timer = RequestTimer(gateway.metrics)
        self.created = int(time.time())

    def _logprobs(self, entries) -> dict | None:
        if not self.body.logprobs:
            return None
        return responses.chat_logprobs(entries, self.names, self.body.top_logprobs or 0)

    def _usage(self, usage: Usage | None) -> dict:
        usages = [usage] if usage is not None else []
        return responses.usage(usages, self.gateway.api.enable_prompt_tokens_details)

    def _finish(self, usage: Usage | None, reasons: list[str]) -> None:
        prompt, generated = (usage.prompt_tokens, usage.completion_tokens) if usage else (0, 0)
        self.timer.finish(prompt, generated, reasons)

    def _call_args(self) -> tuple[tuple, dict]:
        kwargs = {"model": self.body.model or "", "request_id": self.request_id}
        return (self.messages,), {**kwargs, "chat_options": self.options, **self.params}

    async def complete(self) -> dict:
        args, kwargs = self._call_args()
        completion: Completion = await self.gateway.pool.call("chat", *args, **kwargs)
        self.timer.tokens_arrived()
        choices = [
            {
                "index": sample.index,
                "message": {"role": self.role, "content": sample.text},
                "logprobs": self._logprobs(sample.logprobs),
                "finish_reason": responses.finish_reason(sample.finish_reason),
                "stop_reason": responses.stop_reason(sample.finish_reason, sample.matched_stop),
            }
            for sample in completion.samples
        ]
        self._finish(completion.usage, [c["finish_reason"] for c in choices])
        return {
            "id": f"chatcmpl-{self.request_id}",
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self._usage(completion.usage),
        }

    async def chunks(self) -> AsyncIterator[bytes]:
        options = self.body.stream_options
        force = self.gateway.api.enable_force_include_usage
        with_usage = force or bool(options and options.include_usage)
        framer = ChunkFramer(
            f"chatcmpl-{self.request_id}", "chat.completion.chunk", self.created, self.model,
            with_usage,
        )  # fmt: skip
        args, kwargs = self._call_args()
        deltas = self.gateway.pool.stream("chat_stream", *args, **kwargs)
        first = await anext(deltas)  # an error before any output is answered with its status
        for index in range(self.body.n):
            role = {"role": self.role, "content": ""}
            choice = {"index": index, "delta": role, "logprobs": None, "finish_reason": None}
            yield framer.choice(choice)
        usage, reasons = None, []
        delta: Delta | None = first
        while delta is not None:
            yield framer.choice(self._delta_choice(delta, reasons))
            usage = delta.usage or usage
            delta = await anext(deltas, None)
        if with_usage:
            yield framer.usage(self._usage(usage))
        yield DONE
        self._finish(usage, reasons)

    def _delta_choice(self, delta: Delta, reasons: list[str]) -> dict:
        if delta.token_ids:
            self.timer.tokens_arrived()
        reason = responses.finish_reason(delta.finish_reason)
        if reason is not None:
            reasons.append(reason)
        return {
            "index": delta.index,
            "delta": {"content": delta.text} if delta.text else {},
            "logprobs": self._logprobs(delta.logprobs),
            "finish_reason": reason,
            "stop_reason": responses.stop_reason(delta.finish_reason, delta.matched_stop),
        }
