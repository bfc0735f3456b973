"""OpenAI Response objects, built as dicts from the gRPC client's results.

A response echoes the request's parameters as OpenAI does. Its output is a ``reasoning`` item
when the server's reasoning parser found reasoning, a ``message`` item with one ``output_text``
part (unless the output is tool calls alone), then one ``function_call`` item per call.

Status: a stop string, stop token or EOS completes the response; ``max_output_tokens`` or the
context window leaves it ``incomplete`` with reason ``max_output_tokens``, the server's time
limit ``incomplete`` with reason ``time_limit`` (OpenAI has no such limit); a request aborted on
the server (``AdminService.Abort``) or failed in the engine is ``failed``, with an ``error``
saying which (OpenAI's ``cancelled`` is a background response's, which the caller cancels).
"""

from __future__ import annotations

import time
import uuid

from llmrpc.clients import FinishReason, ToolCall, Usage
from llmrpc.gateway.responses_api_input import ResponsesRequest

_INCOMPLETE_REASONS = {
    FinishReason.LENGTH: "max_output_tokens",
    FinishReason.TIME_LIMIT: "time_limit",
}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text_config(body: ResponsesRequest) -> dict:
    fmt = body.text.format if body.text is not None else None
    if fmt is None:
        return {"format": {"type": "text"}, "verbosity": "medium"}
    return {"format": fmt.model_dump(by_alias=True, exclude_none=True), "verbosity": "medium"}


def _tools(body: ResponsesRequest) -> list[dict]:
    return [tool.model_dump(exclude_none=True) for tool in body.tools or ()]


def _tool_choice(body: ResponsesRequest) -> str | dict:
    choice = body.tool_choice
    return choice.model_dump() if hasattr(choice, "model_dump") else choice or "auto"


def envelope(body: ResponsesRequest, response_id: str, model: str) -> dict:
    """The response before any output: what every state of it shares, status in_progress."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": "in_progress",
        "background": False,
        "error": None,
        "incomplete_details": None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "max_tool_calls": None,
        "metadata": body.metadata or {},
        "model": model,
        "output": [],
        "parallel_tool_calls": True
        if body.parallel_tool_calls is None
        else body.parallel_tool_calls,
        "previous_response_id": body.previous_response_id,
        "reasoning": {"effort": None, "summary": None},
        "safety_identifier": body.safety_identifier,
        "service_tier": "default",
        "store": body.store,
        "temperature": body.temperature,
        "text": _text_config(body),
        "tool_choice": _tool_choice(body),
        "tools": _tools(body),
        "top_logprobs": 0,
        "top_p": body.top_p,
        "truncation": "disabled",
        "usage": None,
        "user": body.user,
    }


def outcome(reason: FinishReason | None) -> tuple[str, dict | None, dict | None]:
    """(status, incomplete_details, error) of a response that ended for ``reason``."""
    if reason in _INCOMPLETE_REASONS:
        return "incomplete", {"reason": _INCOMPLETE_REASONS[reason]}, None
    if reason is FinishReason.ABORT:
        return "failed", None, {"code": "aborted", "message": "the request was aborted"}
    if reason is FinishReason.ERROR:
        return "failed", None, {"code": "server_error", "message": "the request failed"}
    return "completed", None, None


def usage(result: Usage | None, reasoning_tokens: int) -> dict:
    prompt, generated = (result.prompt_tokens, result.completion_tokens) if result else (0, 0)
    return {
        "input_tokens": prompt,
        # Prefix caching is automatic: no input is written to a cache by request (OpenAI's
        # explicit cache writes), so none is counted.
        "input_tokens_details": {
            "cached_tokens": result.cached_tokens if result else 0,
            "cache_write_tokens": 0,
        },
        "output_tokens": generated,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": prompt + generated,
    }


def finished(envelope_: dict, reason, output: list[dict], usage_: dict) -> dict:
    """The response as it ended."""
    status, details, error = outcome(reason)
    response = {**envelope_, "status": status, "incomplete_details": details, "error": error}
    response.update(output=output, usage=usage_)
    if status == "completed":
        response["completed_at"] = int(time.time())
    return response


def item_status(response_status: str) -> str:
    return "completed" if response_status == "completed" else "incomplete"


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str | None, status: str) -> dict:
    """A message; ``text`` None: no content part yet (a streamed item just added)."""
    content = [] if text is None else [text_part(text)]
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": content,
    }


def reasoning_part(text: str) -> dict:
    return {"type": "reasoning_text", "text": text}


def reasoning_item(item_id: str, text: str | None, status: str) -> dict:
    content = [] if text is None else [reasoning_part(text)]
    return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "status": status}


def function_call_item(item_id: str, call: ToolCall, arguments: str, status: str) -> dict:
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call.id,
        "name": call.name,
        "arguments": arguments,
        "status": status,
    }


def output_items(text: str, reasoning: str, calls: list[ToolCall], status: str) -> list[dict]:
    """The output of a whole (not streamed) result."""
    items = []
    if reasoning:
        items.append(reasoning_item(new_id("rs"), reasoning, status))
    if text or not calls:
        items.append(message_item(new_id("msg"), text, status))
    items.extend(function_call_item(new_id("fc"), c, c.arguments, status) for c in calls)
    return items


def _texts(output: list[dict], kind: str) -> str:
    items = (item for item in output if item["type"] == kind)
    return "".join(part["text"] for item in items for part in item["content"])


def assistant_message(output: list[dict]) -> dict:
    """The output as the assistant's chat message in the stored conversation; its reasoning
    as ``reasoning_content``, which the chat template shows or not."""
    text = _texts(output, "message")
    calls = [
        {"id": i["call_id"], "type": "function", "function": _function(i)}
        for i in output
        if i["type"] == "function_call"
    ]
    message: dict = {"role": "assistant", "content": text}
    reasoning = _texts(output, "reasoning")
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = calls
    return message


def _function(item: dict) -> dict:
    return {"name": item["name"], "arguments": item["arguments"]}
