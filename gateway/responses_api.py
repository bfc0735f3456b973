"""``POST /v1/responses`` (OpenAI's Responses API), ``GET`` and ``DELETE /v1/responses/{id}``.

A response is a chat request to the gRPC API: the instructions, the stored conversation of
``previous_response_id`` and the input become chat messages (``responses_api_input``), rendered
with the chat template on the replica; the result becomes a Response object
(``responses_api_output``) or, streamed, OpenAI's typed events (``responses_api_stream``).
Responses are kept for later turns unless ``store`` is false (``responses_api_store``), each
for the API key that made it alone.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from llmrpc.clients import ChatOptions, Completion, Delta, LlmrpcError
from llmrpc.gateway import responses
from llmrpc.gateway import responses_api_output as out
from llmrpc.gateway.errors import OpenAIError, from_grpc, invalid
from llmrpc.gateway.json_body import JsonRoute
from llmrpc.gateway.metrics import RequestTimer
from llmrpc.gateway.middleware import caller_key_digest
from llmrpc.gateway.openapi_docs import ERRORS, ResponseObject, answer, response_events
from llmrpc.gateway.param_names import CHAT_PARAMS
from llmrpc.gateway.responses_api_input import (
    Conversation,
    ResponsesRequest,
    chat_tool_choice,
    chat_tools,
    input_conversation,
    refuse_unhonoured,
)
from llmrpc.gateway.responses_api_store import ResponseStore, store_of
from llmrpc.gateway.responses_api_stream import ResponseEvents
from llmrpc.gateway.sse import until_disconnect
from llmrpc.gateway.state import GatewayState, gateway_of, request_id

router = APIRouter(route_class=JsonRoute, responses=ERRORS)

# gRPC field paths -> Responses parameters (chat.messages[i] are added per request).
RESPONSES_PARAMS: dict[str, str | None] = {
    **{field: "input" if name == "messages" else name for field, name in CHAT_PARAMS.items()},
    "stopping.max_tokens": "max_output_tokens",
    "structured_output": "text.format",
    "structured_output.json_schema": "text.format.schema",
    "chat.tools": "tools",
    "chat.tool_choice": "tool_choice",
    "chat.tool_choice.function_name": "tool_choice.name",
    "chat.parallel_tool_calls": "parallel_tool_calls",
}


@router.post("/v1/responses", responses=response_events(ResponseObject))
async def create_response(body: ResponsesRequest, request: Request):
    refuse_unhonoured(body)
    store, owner = store_of(request), caller_key_digest(request.scope)
    previous = body.previous_response_id
    history = store.previous(previous, owner).messages if previous else ()
    gateway = gateway_of(request)
    model = await until_disconnect(request, gateway.model_name(body.model))
    call = ResponseCall(gateway, body, request_id(request), model, history, store, owner)
    if body.stream:
        return await open_stream(request, call.events(), call.names)
    try:
        return await until_disconnect(request, call.complete())
    except LlmrpcError as error:
        raise from_grpc(error, call.names) from None


def _not_found(response_id: str) -> OpenAIError:
    message = f"Response with id '{response_id}' not found."
    return OpenAIError(404, message, "response_id", "not_found")


@router.get("/v1/responses/{response_id}", responses=answer(ResponseObject))
async def retrieve_response(response_id: str, request: Request) -> Response:
    entry = store_of(request).get(response_id, caller_key_digest(request.scope))
    if entry is None:
        raise _not_found(response_id)
    return Response(entry.body, media_type="application/json")  # the JSON as it was stored


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> dict:
    if not store_of(request).delete(response_id, caller_key_digest(request.scope)):
        raise _not_found(response_id)
    return {"id": response_id, "object": "response.deleted", "deleted": True}


def _structured_output(body: ResponsesRequest) -> dict | None:
    """``text.format`` as the gRPC API's StructuredOutput (its JSON form)."""
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"json_object": True}
    if fmt.schema_ is None:
        raise invalid("text.format.schema", "text.format.schema: a json_schema format needs one")
    return {"json_schema": fmt.schema_}


def _prompt(body: ResponsesRequest, history: tuple[dict, ...]) -> tuple[Conversation, list]:
    """(the whole prompt, this turn's own messages: history and input, for the store)."""
    prompt = Conversation()
    if body.instructions is not None:
        prompt.add({"role": "system", "content": body.instructions}, "instructions")
    for message in history:
        prompt.add(message, "previous_response_id")
    own = input_conversation(body)
    for message, origin in zip(own.messages, own.origins, strict=True):
        prompt.add(message, origin)
    return prompt, [*history, *own.messages]


def _param_names(prompt: Conversation, body: ResponsesRequest) -> dict[str, str | None]:
    names = dict(RESPONSES_PARAMS)
    for index in range(len(body.tools or ())):  # chat's tools[i].function.x is tools[i].x here
        names[f"chat.tools[{index}].function"] = f"tools[{index}]"
    for index, (message, origin) in enumerate(zip(prompt.messages, prompt.origins, strict=True)):
        names[f"chat.messages[{index}]"] = origin
        if not origin.startswith("input"):  # no sub-fields of its own to name
            names[f"chat.messages[{index}].content"] = origin
        elif message["role"] == "tool":  # a function_call_output's content is its output
            names[f"chat.messages[{index}].content"] = f"{origin}.output"
    return names


class ResponseCall:
    def __init__(
        self,
        gateway: GatewayState,
        body: ResponsesRequest,
        rid: str,
        model: str,
        history: tuple[dict, ...],
        store: ResponseStore,
        owner: bytes | None = None,
    ) -> None:
        self.gateway = gateway
        self.body = body
        self.request_id = rid
        self.store = store
        self.owner = owner  # the digest of the caller's key: the stored response is its alone
        prompt, self.turn = _prompt(body, history)
        self.messages = prompt.messages
        self.names = _param_names(prompt, body)
        self.kwargs = self._call_kwargs()
        self.envelope = out.envelope(body, out.new_id("resp"), model)
        self.timer = RequestTimer(gateway.metrics)

    def _chat_options(self) -> ChatOptions:
        api, body = self.gateway.api, self.body
        content_format = api.chat_template_content_format
        return ChatOptions(
            add_generation_prompt=True,
            chat_template=api.chat_template,
            content_format=None if content_format == "auto" else content_format,
            tools=chat_tools(body.tools),
            tool_choice=chat_tool_choice(body.tool_choice),
            parallel_tool_calls=body.parallel_tool_calls,
        )

    def _call_kwargs(self) -> dict:
        body = self.body
        params = {
            "temperature": body.temperature,
            "top_p": body.top_p,
            "max_tokens": body.max_output_tokens,
            "structured_output": _structured_output(body),
        }
        kwargs = {name: value for name, value in params.items() if value is not None}
        kwargs.update(self.gateway.grpc_model(body.model), request_id=self.request_id)
        return {**kwargs, "chat_options": self._chat_options()}

    async def _reasoning_tokens(self, reasoning: str) -> int:
        """The reasoning's length in tokens, told by the tokenizer (the gRPC API counts
        output tokens, reasoning or not, as one)."""
        if not reasoning:
            return 0
        model = self.gateway.grpc_model(self.body.model)["model"]  # an adapter's is its base's
        kwargs = {"model": model, "add_special_tokens": False}
        return (await self.gateway.pool.call("tokenize", reasoning, **kwargs)).count

    def _end(self, response: dict, usage, reason) -> None:
        if self.body.store:
            messages = (*self.turn, out.assistant_message(response["output"]))
            self.store.put(response, messages, self.owner)
        prompt, generated = (usage.prompt_tokens, usage.completion_tokens) if usage else (0, 0)
        self.timer.finish(prompt, generated, [responses.finish_reason(reason) or "stop"])

    async def complete(self) -> dict:
        result: Completion = await self.gateway.pool.call("chat", self.messages, **self.kwargs)
        self.timer.tokens_arrived()
        status = out.outcome(result.finish_reason)[0]
        output = out.output_items(
            result.text, result.reasoning_text, result.tool_calls, out.item_status(status)
        )
        reasoning_tokens = await self._reasoning_tokens(result.reasoning_text)
        usage = out.usage(result.usage, reasoning_tokens)
        response = out.finished(self.envelope, result.finish_reason, output, usage)
        self._end(response, result.usage, result.finish_reason)
        return response

    async def events(self) -> AsyncIterator[bytes]:
        deltas = self.gateway.pool.stream("chat_stream", self.messages, **self.kwargs)
        try:
            first = await anext(deltas)  # an error before any output is answered with its status
            stream = ResponseEvents(self.envelope)
            yield b"".join(stream.start())
            try:
                async for chunk in self._relay(first, deltas, stream):
                    yield chunk
            except LlmrpcError as error:
                yield stream.error(from_grpc(error, self.names))
        finally:
            await deltas.aclose()

    async def _relay(
        self, first: Delta, deltas: AsyncIterator[Delta], stream: ResponseEvents
    ) -> AsyncIterator[bytes]:
        usage, reason, reasoning = None, None, []
        delta: Delta | None = first
        while delta is not None:
            yield b"".join(self._delta_events(delta, stream))
            usage, reason = delta.usage or usage, delta.finish_reason or reason
            reasoning.append(delta.reasoning_text)
            delta = await anext(deltas, None)
        reasoning_tokens = await self._reasoning_tokens("".join(reasoning))
        yield b"".join(stream.finish(reason, out.usage(usage, reasoning_tokens)))
        self._end(stream.response, usage, reason)

    def _delta_events(self, delta: Delta, stream: ResponseEvents) -> list[bytes]:
        if delta.token_ids:
            self.timer.tokens_arrived()
        events = []
        if delta.reasoning_text:
            events.extend(stream.text(delta.reasoning_text, "reasoning"))
        if delta.text:
            events.extend(stream.text(delta.text, "message"))
        for call in delta.tool_calls:
            events.extend(stream.tool_call(call))
        return events


async def open_stream(
    request: Request, events: AsyncIterator[bytes], names: dict
) -> StreamingResponse:
    """An SSE response from ``events``, sent once the first exists: an error before it is
    answered with its HTTP status (after it, ``events`` sends an error event itself)."""
    try:
        first = await until_disconnect(request, anext(events))
    except LlmrpcError as error:
        await events.aclose()
        raise from_grpc(error, names) from None
    except BaseException:
        await events.aclose()
        raise
    return StreamingResponse(_body(first, events), media_type="text/event-stream")


async def _body(first: bytes, events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    try:
        yield first
        async for chunk in events:
            yield chunk
    finally:
        await events.aclose()
