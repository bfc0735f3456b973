"""``POST /v1/chat/completions``: the messages go to the gRPC API as chat input, rendered with
the chat template on the replica (``add_generation_prompt``, ``continue_final_message``,
``chat_template``, ``chat_template_kwargs`` travel with them).

Tools, tool choice and the tool calls and results of the history travel the same way; the
replica reads calls and reasoning out of the output (``--tool-call-parser``,
``--reasoning-parser``). An answer's ``message`` carries ``tool_calls`` (``content`` null when
there are calls alone) and ``reasoning_content`` (also as vLLM's ``reasoning``); a choice that
made calls finishes with "tool_calls".

A stream opens, once the replica has answered, with a chunk per choice carrying the role;
then content and reasoning deltas, and each call as OpenAI streams one; each choice's last
chunk has its ``finish_reason``.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request

from llmrpc.clients import (
    Completion,
    Delta,
    FinishReason,
    LlmrpcError,
    Sample,
    ToolCall,
    Usage,
)
from llmrpc.gateway import fanout, params, responses
from llmrpc.gateway.errors import from_grpc
from llmrpc.gateway.json_body import JsonRoute
from llmrpc.gateway.metrics import RequestTimer
from llmrpc.gateway.openai_models import ChatCompletionRequest
from llmrpc.gateway.openapi_docs import ERRORS, ChatCompletion, generation
from llmrpc.gateway.param_names import CHAT_PARAMS
from llmrpc.gateway.sse import DONE, ChunkFramer, first_then_rest, until_disconnect
from llmrpc.gateway.state import GatewayState, gateway_of, request_id

router = APIRouter(route_class=JsonRoute, responses=ERRORS)


# What a tool choice's errors name on the gRPC side -> OpenAI's parameter.
_TOOL_PARAMS = {"chat.tool_choice.function_name": "tool_choice.function.name"}


def param_names(body: ChatCompletionRequest) -> dict[str, str | None]:
    """gRPC field paths -> this request's parameters: max_tokens is max_completion_tokens when
    the caller used that name."""
    names = {**CHAT_PARAMS, **_TOOL_PARAMS}
    if body.max_completion_tokens is not None:
        names["stopping.max_tokens"] = "max_completion_tokens"
    return names


@router.post("/v1/chat/completions", responses=generation(ChatCompletion))
async def create_chat_completion(body: ChatCompletionRequest, request: Request):
    gateway = gateway_of(request)
    model = await until_disconnect(request, gateway.model_name(body.model))
    call = ChatCall(gateway, body, request_id(request), model)
    names = {**param_names(body), **call.param_names}
    if body.stream:
        return await first_then_rest(request, call.chunks(), names)
    try:
        return await until_disconnect(request, call.complete())
    except LlmrpcError as error:
        raise from_grpc(error, names) from None


def _tool_call(call: ToolCall) -> dict:
    function = {"name": call.name, "arguments": call.arguments}
    return {"id": call.id, "type": call.type, "function": function}


def _finish_reason(reason: FinishReason | None, made_calls: bool) -> str | None:
    """OpenAI's: "tool_calls" when an output that ended normally made calls the model chose
    (a call forced by a named tool_choice ends with "stop", as OpenAI's does)."""
    shown = responses.finish_reason(reason)
    return "tool_calls" if made_calls and shown == "stop" else shown


class ChatCall:
    def __init__(self, gateway: GatewayState, body: ChatCompletionRequest, rid: str, model: str):
        api = gateway.api
        self.gateway = gateway
        self.body = body
        self.request_id = rid
        self.model = model
        fanout.check_sequences(api, 1, body.n, "messages")
        self.messages = params.chat_messages(body.messages)
        self.options = params.chat_options(body, api)
        self.params, self.param_names = params.chat_params(body)
        self.role = params.response_role(body, api)
        as_ids = api.return_tokens_as_token_ids or bool(body.return_tokens_as_token_ids)
        self.names = responses.TokenNames(as_ids)
        self.timer = RequestTimer(gateway.metrics)
        self.created = int(time.time())
        self.named_choice = body.tool_choice is not None and not isinstance(body.tool_choice, str)

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
        kwargs = {**self.gateway.grpc_model(self.body.model), "request_id": self.request_id}
        return (self.messages,), {**kwargs, "chat_options": self.options, **self.params}

    def _add_reasoning(self, message: dict, reasoning: str) -> None:
        # Under both names: reasoning_content (DeepSeek's API, vLLM before 0.11) and reasoning
        # (vLLM's current name).
        if reasoning and self.body.include_reasoning:
            message["reasoning_content"] = message["reasoning"] = reasoning

    def _message(self, sample: Sample) -> dict:
        message: dict = {"role": self.role, "content": sample.text}
        if sample.tool_calls:
            message["content"] = sample.text or None  # as OpenAI: null when calls alone
            message["tool_calls"] = [_tool_call(call) for call in sample.tool_calls]
        self._add_reasoning(message, sample.reasoning_text)
        return message

    async def complete(self) -> dict:
        args, kwargs = self._call_args()
        completion: Completion = await self.gateway.pool.call("chat", *args, **kwargs)
        self.timer.tokens_arrived()
        choices = [
            {
                "index": sample.index,
                "message": self._message(sample),
                "logprobs": self._logprobs(sample.logprobs),
                "finish_reason": _finish_reason(
                    sample.finish_reason, bool(sample.tool_calls) and not self.named_choice
                ),
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
        stream = _ChatStream(self)
        delta: Delta | None = first
        while delta is not None:
            for choice in stream.choices(delta):
                yield framer.choice(choice)
            delta = await anext(deltas, None)
        if with_usage:
            yield framer.usage(self._usage(stream.usage))
        yield DONE
        self._finish(stream.usage, stream.reasons)


class _ChatStream:
    """The chunks of a streamed chat completion, per delta: its content and reasoning, then each
    call completed in it as OpenAI streams calls (a chunk with its index, id, type, name and
    empty arguments, then one with the arguments), the finish reason on the last."""

    def __init__(self, call: ChatCall) -> None:
        self.call = call
        self.usage: Usage | None = None
        self.reasons: list[str] = []
        self.made_calls: set[int] = set()  # choices that made a call

    def choices(self, delta: Delta) -> list[dict]:
        call = self.call
        if delta.token_ids:
            call.timer.tokens_arrived()
        self.usage = delta.usage or self.usage
        text = {"content": delta.text} if delta.text else {}
        call._add_reasoning(text, delta.reasoning_text)
        chunks = [self._chunk(delta.index, text, call._logprobs(delta.logprobs))]
        for tool_call in delta.tool_calls:
            self.made_calls.add(delta.index)
            header = {"name": tool_call.name, "arguments": ""}
            first = {"index": tool_call.index, "id": tool_call.id, "type": tool_call.type}
            chunks.append(self._chunk(delta.index, {"tool_calls": [{**first, "function": header}]}))
            arguments = {"index": tool_call.index, "function": {"arguments": tool_call.arguments}}
            chunks.append(self._chunk(delta.index, {"tool_calls": [arguments]}))
        if len(chunks) > 1 and not text:  # no content chunk when there is none to send
            chunks[1]["logprobs"] = chunks.pop(0)["logprobs"]
        made_calls = delta.index in self.made_calls and not call.named_choice
        reason = _finish_reason(delta.finish_reason, made_calls)
        if reason is not None:
            self.reasons.append(reason)
        chunks[-1]["finish_reason"] = reason
        chunks[-1]["stop_reason"] = responses.stop_reason(delta.finish_reason, delta.matched_stop)
        return chunks

    @staticmethod
    def _chunk(index: int, delta: dict, logprobs: dict | None = None) -> dict:
        return {
            "index": index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": None,
            "stop_reason": None,
        }
