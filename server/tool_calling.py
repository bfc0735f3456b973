"""Tools in chat requests: their checks, their form for chat templates, and the calls that
``tool_choice`` REQUIRED or a named function forces.

A chat's ``tool_choice`` comes to one of four modes. NONE (or no tools): the output is text.
AUTO (unset with tools): the model decides, and the server's ``--tool-call-parser`` reads its
calls, so it needs ``--enable-auto-tool-choice``. NAMED and REQUIRED: the output is held by
structured output to a JSON schema built as vLLM builds it, so it always parses: the named
function's arguments object, or a JSON array of ``{"name", "parameters"}`` objects, one per call
(at least one; exactly one when ``parallel_tool_calls`` is false).

Errors are ``InvalidArgument`` naming the request's field (``chat.tools[3].function.name``).
"""

from __future__ import annotations

import enum
import json
import logging
from dataclasses import dataclass
from typing import Any

from llmrpc.server.errors import InvalidArgument
from llmrpc.server.tool_parsers import FunctionCall
from llmrpc.v1 import common_pb2

logger = logging.getLogger(__name__)

MAX_TOOLS = 128
MAX_TOOL_NAME_CHARS = 256
# What a chat template may never show the model (many ignore tools), so no context window bounds
# it: a description, a parameters schema (its JSON text), and all of them together.
MAX_TOOL_DESCRIPTION_CHARS = 16_384
MAX_TOOL_PARAMETERS_CHARS = 65_536
MAX_TOOLS_CHARS = 1_048_576
_Mode = common_pb2.ToolChoice.Mode
# Integers beyond this are left as the floats a Struct holds (JSON numbers past 2^53 are lossy).
_LARGEST_INT = 2**53


class ToolMode(enum.Enum):
    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools mean for its output."""

    mode: ToolMode = ToolMode.NONE
    function_name: str | None = None  # NAMED: the function every output calls
    parallel: bool = True  # false: at most one call per output

    @property
    def forced(self) -> bool:
        return self.mode in (ToolMode.REQUIRED, ToolMode.NAMED)


# --- parameters ------------------------------------------------------------------------------


def parameters_dict(tool: common_pb2.Tool) -> dict[str, Any] | None:
    """A tool's parameters schema (JSON text; checked by ``_check_tool``); None when unset."""
    if not tool.function.HasField("parameters"):
        return None
    return json.loads(tool.function.parameters)


# --- checks -----------------------------------------------------------------------------------


def _check_tool(tool: common_pb2.Tool, index: int, seen: set[str]) -> None:
    path = f"chat.tools[{index}]"
    if tool.type not in ("", "function"):
        raise InvalidArgument(f"{path}.type", f"only function tools exist, not {tool.type!r}")
    name = tool.function.name
    if not name.strip():
        raise InvalidArgument(f"{path}.function.name", "a tool needs a name")
    if len(name) > MAX_TOOL_NAME_CHARS:
        raise InvalidArgument(
            f"{path}.function.name", f"at most {MAX_TOOL_NAME_CHARS} characters, got {len(name)}"
        )
    if name in seen:
        raise InvalidArgument(f"{path}.function.name", f"{name!r} names an earlier tool too")
    seen.add(name)
    _check_length(
        f"{path}.function.description", tool.function.description, MAX_TOOL_DESCRIPTION_CHARS
    )
    if tool.function.HasField("parameters"):
        _check_length(
            f"{path}.function.parameters", tool.function.parameters, MAX_TOOL_PARAMETERS_CHARS
        )
        try:
            parameters = json.loads(tool.function.parameters)
        except (ValueError, RecursionError) as error:
            raise InvalidArgument(f"{path}.function.parameters", f"not JSON: {error}") from None
        if not isinstance(parameters, dict):
            raise InvalidArgument(f"{path}.function.parameters", "must be a JSON object")


def _check_length(field: str, text: str, limit: int) -> None:
    if len(text) > limit:
        raise InvalidArgument(field, f"at most {limit} characters, got {len(text)}")


def _check_tools(chat: common_pb2.Chat) -> None:
    if len(chat.tools) > MAX_TOOLS:
        raise InvalidArgument("chat.tools", f"at most {MAX_TOOLS} tools, got {len(chat.tools)}")
    seen: set[str] = set()
    for index, tool in enumerate(chat.tools):
        _check_tool(tool, index, seen)
    total = sum(len(t.function.description) + len(t.function.parameters) for t in chat.tools)
    if total > MAX_TOOLS_CHARS:
        raise InvalidArgument(
            "chat.tools",
            f"descriptions and parameters of at most {MAX_TOOLS_CHARS} characters in all, got "
            f"{total}",
        )


def _mode(chat: common_pb2.Chat) -> tuple[ToolMode, str | None]:
    choice = chat.tool_choice
    which = choice.WhichOneof("choice") if chat.HasField("tool_choice") else None
    if which == "function_name":
        return ToolMode.NAMED, choice.function_name
    mode = choice.mode if which == "mode" else _Mode.MODE_UNSPECIFIED
    if mode == _Mode.MODE_UNSPECIFIED:
        return (ToolMode.AUTO if chat.tools else ToolMode.NONE), None
    return {
        _Mode.MODE_NONE: ToolMode.NONE,
        _Mode.MODE_AUTO: ToolMode.AUTO,
        _Mode.MODE_REQUIRED: ToolMode.REQUIRED,
    }[mode], None


def tool_plan(chat: common_pb2.Chat, auto_tool_choice: bool | None) -> ToolPlan:
    """The checked plan of a chat's tools. ``auto_tool_choice``: whether the server reads calls
    the model chooses to make (``--enable-auto-tool-choice`` with a parser); None when nothing
    is generated (tokenization), so AUTO is not checked."""
    _check_tools(chat)
    mode, name = _mode(chat)
    if mode is not ToolMode.NONE and not chat.tools:
        raise InvalidArgument("chat.tool_choice", "a tool choice needs chat.tools")
    if mode is ToolMode.NAMED and name not in {tool.function.name for tool in chat.tools}:
        raise InvalidArgument(
            "chat.tool_choice.function_name", f"{name!r} is not the name of one of chat.tools"
        )
    if mode is ToolMode.AUTO and auto_tool_choice is False:
        raise InvalidArgument(
            "chat.tool_choice",
            '"auto" tool choice (the default with tools) requires the server to be started with '
            "--enable-auto-tool-choice and --tool-call-parser; or set tool_choice none, "
            "required or a function",
        )
    parallel = not chat.HasField("parallel_tool_calls") or chat.parallel_tool_calls
    return ToolPlan(mode, name, parallel)


# --- what chat templates are given ------------------------------------------------------------


def template_tools(chat: common_pb2.Chat) -> list[dict[str, Any]]:
    """The tools in OpenAI's shape, as templates read them (unset fields left out)."""
    tools = []
    for tool in chat.tools:
        function: dict[str, Any] = {"name": tool.function.name}
        if tool.function.description:
            function["description"] = tool.function.description
        if tool.function.HasField("parameters"):
            function["parameters"] = parameters_dict(tool)
        if tool.function.HasField("strict"):
            function["strict"] = tool.function.strict
        tools.append({"type": "function", "function": function})
    return tools


def _arguments_object(call: common_pb2.ToolCall) -> dict[str, Any]:
    """A call's arguments as the dict templates want (as vLLM gives them). Text that is not a
    JSON object becomes {}: it sits in the history, and refusing it would end the conversation."""
    if not call.function.arguments.strip():
        return {}
    try:
        arguments = json.loads(call.function.arguments)
    except (ValueError, RecursionError):
        arguments = None
    if not isinstance(arguments, dict):
        logger.warning(
            "tool call %r: arguments are not a JSON object; the template gets {}",
            call.function.name,
        )
        return {}
    return arguments


def template_tool_calls(message: common_pb2.ChatMessage) -> list[dict[str, Any]]:
    return [
        {
            "id": call.id,
            "type": call.type or "function",
            "function": {"name": call.function.name, "arguments": _arguments_object(call)},
        }
        for call in message.tool_calls
    ]


# --- forced calls -----------------------------------------------------------------------------


def _parameters(tool: common_pb2.Tool) -> dict[str, Any]:
    # Missing or empty parameters still hold the arguments to a JSON object.
    return parameters_dict(tool) or {"type": "object", "properties": {}}


def _hoisted_defs(chat: common_pb2.Chat, schemas: list[dict[str, Any]]) -> dict[str, Any]:
    """Each tool's ``$defs`` moved to the root, where its ``#/$defs/...`` references point once
    the schema sits inside the array's."""
    found: dict[str, Any] = {}
    for index, schema in enumerate(schemas):
        defs = schema.pop("$defs", {})
        path = f"chat.tools[{index}].function.parameters"
        if not isinstance(defs, dict):
            raise InvalidArgument(path, "$defs must be an object")
        for name, definition in defs.items():
            if found.get(name, definition) != definition:
                raise InvalidArgument(path, f"$defs {name!r} differs from another tool's")
            found[name] = definition
    return found


def forced_schema(chat: common_pb2.Chat, plan: ToolPlan) -> dict[str, Any]:
    """The JSON schema that holds a NAMED or REQUIRED output to its calls."""
    if plan.mode is ToolMode.NAMED:
        tool = next(t for t in chat.tools if t.function.name == plan.function_name)
        return _parameters(tool)
    parameters = [_parameters(tool) for tool in chat.tools]
    defs = _hoisted_defs(chat, parameters)
    calls = [
        {
            "properties": {
                "name": {"type": "string", "enum": [tool.function.name]},
                "parameters": schema,
            },
            "required": ["name", "parameters"],
        }
        for tool, schema in zip(chat.tools, parameters, strict=True)
    ]
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {"type": "object", "anyOf": calls},
    }
    if not plan.parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _json(text: str) -> Any:
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        return None


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, allow_nan=False)


def forced_calls(text: str, plan: ToolPlan) -> list[FunctionCall] | None:
    """The calls of a NAMED or REQUIRED output; None when it does not parse (an output cut by
    max_tokens, say): the text is then content."""
    value = _json(text)
    if plan.mode is ToolMode.NAMED:
        if not isinstance(value, dict):
            return None
        return [FunctionCall(plan.function_name, _dumps(value))]
    if not isinstance(value, list) or not value:
        return None
    calls = []
    for item in value:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        arguments = item.get("parameters", {})
        if not isinstance(arguments, dict):
            return None
        calls.append(FunctionCall(item["name"], _dumps(arguments)))
    return calls
