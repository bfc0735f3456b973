"""Tool-call parsers: a model's generated text as OpenAI ``tool_calls`` plus content.

Each parser reads one model family's way of writing calls (``--tool-call-parser NAME``):

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, any number.
- ``llama3_json``: ``{"name": ..., "parameters": {...}}`` (or ``"arguments"``) opening the output or
  following ``<|python_tag|>``; several calls are separated by ``;``.
- ``mistral``: ``[TOOL_CALLS]`` then a JSON list of ``{"name", "arguments"}`` objects (or one
  object), or the newer ``[TOOL_CALLS]name[ARGS]{...}``. Its call ids are 9 alphanumerics, the form
  Mistral's chat templates require of ids sent back in the history.
- ``pythonic``: a Python list of keyword-argument calls, ``[f(x=1), g(s="a")]``, as the first thing
  on a line; arguments must be literals (read with ``ast``, never evaluated).
- ``qwen3_coder``: ``<tool_call><function=NAME><parameter=KEY>value</parameter>...</function>
  </tool_call>``; a value that parses as JSON becomes that JSON value, any other value a string
  (one newline after the opening and before the closing parameter tag is layout, not value).

``parse(text)`` gives ``ParsedOutput(content, tool_calls)``: the content is the text outside the
calls as written (None when it is empty or whitespace only); a ``ToolCall`` has an id, a name and
its arguments as a JSON object string. ``stream()`` gives a per-request ``ToolCallStream``:
``feed`` and ``finish`` return ``ContentDelta`` and ``ToolCallDelta`` items shaped as OpenAI
streams them. For any split of the text, the streamed content and each call's argument fragments
concatenate to exactly what ``parse`` returns.

Malformed calls are content, never errors: text that starts like a call but does not complete one
(bad JSON, no name, an unclosed tag, a pythonic argument that is not a literal) stays in the
content as written and makes no call. While streaming, text that may still be the start of a
marker (``<tool`` at the end of a delta) is held back until it is decided, so no marker of a call
reaches the content; a call is sent once its text is complete (a header delta, then its arguments
in one fragment), as until then it could still turn out malformed.

Plugins: ``load_tool_parser_plugin(path)`` imports a Python file that registers parsers with
``@register_tool_parser("name")`` (``--tool-parser-plugin``).
"""

from __future__ import annotations

import ast
import json
import logging
import math
import re
import secrets
import string
from abc import ABC, abstractmethod
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, NamedTuple

from llmrpc.server.parser_registry import LeadingSpace, ParserRegistry, held_from

logger = logging.getLogger(__name__)

_ALPHANUMERICS = string.ascii_letters + string.digits
_SPACE = re.compile(r"\s*")


def random_call_id(prefix: str = "call_", length: int = 24) -> str:
    """A tool call id: ``prefix`` and ``length`` random letters and digits."""
    return prefix + "".join(secrets.choice(_ALPHANUMERICS) for _ in range(length))


class FunctionCall(NamedTuple):
    """A complete call as a parser reads it: a name and the arguments as a JSON object string."""

    name: str
    arguments: str


@dataclass(frozen=True)
class ToolCall:
    """One call of a whole parse, as OpenAI's ``message.tool_calls`` holds it."""

    id: str
    name: str
    arguments: str
    type: str = "function"

    def to_dict(self) -> dict[str, Any]:
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": self.type, "function": function}


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None
    tool_calls: list[ToolCall]


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class FunctionDelta:
    name: str | None = None
    arguments: str = ""


@dataclass(frozen=True)
class ToolCallDelta:
    """One item of OpenAI's ``delta.tool_calls``. A call's first delta has ``id``, ``type`` and
    ``function.name`` (arguments ""); its later deltas have only ``function.arguments``."""

    index: int
    function: FunctionDelta
    id: str | None = None
    type: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            out.update(id=self.id, type=self.type)
        function: dict[str, str] = {"arguments": self.function.arguments}
        if self.function.name is not None:
            function = {"name": self.function.name, **function}
        out["function"] = function
        return out


Delta = ContentDelta | ToolCallDelta
Segment = str | FunctionCall


class Step(NamedTuple):
    """What a parser decided: content text and calls, in order, up to ``pos``; then ``state``."""

    segments: list[Segment]
    pos: int
    state: Hashable = None


class ToolParser(ABC):
    """One output format. Stateless: a request's progress lives in its ``ToolCallStream``.

    Subclasses implement ``step``: read ``text`` from ``pos`` (text before ``pos`` may be gone) in
    the format's ``state`` and decide what comes next. When ``final`` is false more text may follow:
    decide only what no continuation could change, and return None when nothing is decided yet.
    When ``final`` is true the text is all there is. Each step moves ``pos`` or changes ``state``.
    Keeping to this is what makes streaming agree with ``parse`` for any split of the text.
    """

    initial_state: Hashable = None

    @abstractmethod
    def step(self, text: str, pos: int, state: Hashable, final: bool) -> Step | None: ...

    def new_call_id(self) -> str:
        return random_call_id()

    def parse(self, text: str) -> ParsedOutput:
        segments, _, _ = self.scan(text, self.initial_state, final=True)
        content = "".join(s for s in segments if isinstance(s, str))
        calls = [
            ToolCall(self.new_call_id(), s.name, s.arguments)
            for s in segments
            if isinstance(s, FunctionCall)
        ]
        return ParsedOutput(content if content.strip() else None, calls)

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self)

    def scan(self, text: str, state: Hashable, final: bool) -> tuple[list[Segment], int, Hashable]:
        """Steps from the start of ``text``: the segments decided, where they end, the state."""
        segments: list[Segment] = []
        pos = 0
        while pos < len(text):
            step = self.step(text, pos, state, final)
            if step is None:
                if not final:
                    break
                step = Step([text[pos:]], len(text), state)  # undecided at the end: content
            if step.pos < pos or (step.pos, step.state) == (pos, state):
                raise RuntimeError(f"{type(self).__name__}.step made no progress at {pos}")
            segments.extend(step.segments)
            pos, state = step.pos, step.state
        return segments, pos, state


class ToolCallStream:
    """The incremental parse of one request's output: ``feed`` each new piece, then ``finish``."""

    def __init__(self, parser: ToolParser) -> None:
        self._parser = parser
        self._pending = ""  # text not decided yet
        self._state = parser.initial_state
        self._num_calls = 0
        self._content = LeadingSpace()
        self._finished = False

    def feed(self, delta_text: str) -> list[Delta]:
        if self._finished:
            raise RuntimeError("ToolCallStream.feed after finish")
        self._pending += delta_text
        return self._advance(final=False)

    def finish(self) -> list[Delta]:
        """The rest, now that the output is complete (held text, calls left unclosed as content)."""
        if self._finished:
            return []
        self._finished = True
        return self._advance(final=True)

    def _advance(self, final: bool) -> list[Delta]:
        segments, pos, self._state = self._parser.scan(self._pending, self._state, final)
        self._pending = self._pending[pos:]
        deltas: list[Delta] = []
        for segment in segments:
            if isinstance(segment, FunctionCall):
                deltas.extend(self._call_deltas(segment))
            elif text := self._content.release(segment):
                if deltas and isinstance(deltas[-1], ContentDelta):
                    text = deltas.pop().text + text
                deltas.append(ContentDelta(text))
        return deltas

    def _call_deltas(self, call: FunctionCall) -> list[Delta]:
        index = self._num_calls
        self._num_calls += 1
        header = FunctionDelta(name=call.name, arguments="")
        deltas: list[Delta] = [
            ToolCallDelta(index, header, id=self._parser.new_call_id(), type="function")
        ]
        if call.arguments:
            deltas.append(ToolCallDelta(index, FunctionDelta(arguments=call.arguments)))
        return deltas


# --- shared pieces of the formats -------------------------------------------------------------


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is out of range")
    return value


# Strict JSON: no NaN/Infinity, no float that overflows (json.dumps would write them as non-JSON).
_DECODER = json.JSONDecoder(parse_constant=_reject_constant, parse_float=_finite_float)
_INCOMPLETE = object()  # a value that more text may still complete


def _dumps(arguments: dict[str, Any]) -> str:
    return json.dumps(arguments, ensure_ascii=False, allow_nan=False)


def _decode_json(text: str, start: int, final: bool) -> Any:
    """The JSON object or list at ``text[start]`` and its end; None if there is none."""
    if start == len(text):
        return None if final else _INCOMPLETE
    if text[start] not in "[{":
        return None
    try:
        return _DECODER.raw_decode(text, start)
    except (ValueError, RecursionError):
        return None if final else _INCOMPLETE


def _json_arguments(value: Any) -> str | None:
    """Arguments as a JSON object string: an object, or a string holding one (double-encoded)."""
    if isinstance(value, str):
        try:
            value = _DECODER.decode(value)
        except (ValueError, RecursionError):
            return None
    return _dumps(value) if isinstance(value, dict) else None


def _call_from_json(obj: Any, arguments_required: bool = False) -> FunctionCall | None:
    """``{"name": ..., "arguments"|"parameters": {...}}`` as a call; None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"].strip():
        return None
    key = next((k for k in ("arguments", "parameters") if k in obj), None)
    if key is None:
        return None if arguments_required else FunctionCall(obj["name"].strip(), "{}")
    arguments = _json_arguments(obj[key])
    return None if arguments is None else FunctionCall(obj["name"].strip(), arguments)


def _content_step(
    text: str, pos: int, found: int, marker: str, final: bool, state: Hashable
) -> Step | None:
    """Content from ``pos`` to a marker found at ``found`` (-1: none yet)."""
    end = found if found >= 0 else len(text) if final else held_from(text, pos, marker)
    return Step([text[pos:end]], end, state) if end > pos else None


# --- the registry and the formats -----------------------------------------------------------------

REGISTRY: ParserRegistry[type[ToolParser]] = ParserRegistry(
    ToolParser, "tool parser", "--tool-call-parser", "--tool-parser-plugin"
)
register_tool_parser = REGISTRY.register
get_tool_parser = REGISTRY.get
tool_parser_names = REGISTRY.names
load_tool_parser_plugin = REGISTRY.load_plugin


class TaggedToolParser(ToolParser):
    """Calls written as ``start_tag`` body ``end_tag`` blocks amid content."""

    start_tag: str
    end_tag: str

    @abstractmethod
    def parse_body(self, body: str) -> list[FunctionCall] | None:
        """The calls of one block's body; None (or none) if it is malformed: it stays content."""

    def step(self, text: str, pos: int, state: Hashable, final: bool) -> Step | None:
        start = text.find(self.start_tag, pos)
        if start != pos:
            return _content_step(text, pos, start, self.start_tag, final, state)
        body_start = pos + len(self.start_tag)
        end = text.find(self.end_tag, body_start)
        if end < 0:  # unclosed: content if the output ends so
            return Step([text[pos:]], len(text), state) if final else None
        after = end + len(self.end_tag)
        calls = self.parse_body(text[body_start:end])
        return Step(list(calls) if calls else [text[pos:after]], after, state)


@register_tool_parser("hermes")
class HermesToolParser(TaggedToolParser):
    start_tag = "<tool_call>"
    end_tag = "</tool_call>"

    def parse_body(self, body: str) -> list[FunctionCall] | None:
        try:
            call = _call_from_json(_DECODER.decode(body.strip()))
        except (ValueError, RecursionError):
            return None
        return [call] if call else None


_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*)</function>\s*", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


def _parameter_value(raw: str) -> Any:
    value = raw[1:] if raw.startswith("\n") else raw
    value = value[:-1] if value.endswith("\n") else value
    try:
        return _DECODER.decode(value)
    except (ValueError, RecursionError):
        return value


@register_tool_parser("qwen3_coder")
class Qwen3CoderToolParser(TaggedToolParser):
    start_tag = "<tool_call>"
    end_tag = "</tool_call>"

    def parse_body(self, body: str) -> list[FunctionCall] | None:
        function = _FUNCTION.fullmatch(body)
        if function is None or not function.group(1).strip():
            return None
        inner, arguments, last = function.group(2), {}, 0
        for parameter in _PARAMETER.finditer(inner):
            if inner[last : parameter.start()].strip():
                return None
            arguments[parameter.group(1).strip()] = _parameter_value(parameter.group(2))
            last = parameter.end()
        if inner[last:].strip():
            return None
        return [FunctionCall(function.group(1).strip(), _dumps(arguments))]


_MISTRAL_NAME = re.compile(r"[A-Za-z0-9_.\-]+")
_ARGS = "[ARGS]"


@register_tool_parser("mistral")
class MistralToolParser(ToolParser):
    marker = "[TOOL_CALLS]"

    def new_call_id(self) -> str:
        return random_call_id(prefix="", length=9)

    def step(self, text: str, pos: int, state: Hashable, final: bool) -> Step | None:
        found = text.find(self.marker, pos)
        if found != pos:
            return _content_step(text, pos, found, self.marker, final, state)
        start = _SPACE.match(text, pos + len(self.marker)).end()
        calls = self._calls_at(text, start, final)
        if calls is _INCOMPLETE:
            return None
        if calls is None:  # not a call: the marker is content
            return Step([text[pos:start]], start, state)
        return Step(calls[0], calls[1], state)

    def _calls_at(self, text: str, start: int, final: bool) -> Any:
        name = _MISTRAL_NAME.match(text, start)
        if name is not None:  # name[ARGS]{...}
            args_at = name.end()
            if not text.startswith(_ARGS, args_at):
                undecided = not final and _ARGS.startswith(text[args_at:])
                return _INCOMPLETE if undecided else None
            decoded = _decode_json(text, args_at + len(_ARGS), final)
            if decoded is None or decoded is _INCOMPLETE:
                return decoded
            arguments = _json_arguments(decoded[0])
            return None if arguments is None else ([FunctionCall(name[0], arguments)], decoded[1])
        decoded = _decode_json(text, start, final)
        if decoded is None or decoded is _INCOMPLETE:
            return decoded
        items = decoded[0] if isinstance(decoded[0], list) else [decoded[0]]
        calls = [_call_from_json(item) for item in items]
        return (calls, decoded[1]) if calls and None not in calls else None


def _object_call(text: str, start: int, final: bool) -> Any:
    """The llama3 call object at ``text[start]`` and its end, None, or _INCOMPLETE."""
    decoded = _decode_json(text, start, final)
    if decoded is None or decoded is _INCOMPLETE:
        return decoded
    call = _call_from_json(decoded[0], arguments_required=True)
    return (call, decoded[1]) if call else None


@register_tool_parser("llama3_json")
class Llama3JsonToolParser(ToolParser):
    """States: "start" (a call may open the output), "text", "sequence" (after a call)."""

    marker = "<|python_tag|>"
    initial_state = "start"

    def step(self, text: str, pos: int, state: Hashable, final: bool) -> Step | None:
        if state == "sequence":
            return self._next_call(text, pos, final)
        if state == "start":
            start = _SPACE.match(text, pos).end()
            if start == len(text) and not final:
                return None
            call = _object_call(text, start, final) if start < len(text) else None
            if call is _INCOMPLETE:
                return None
            if call is None:
                return Step([], pos, "text")
            return Step([text[pos:start], call[0]], call[1], "sequence")
        found = text.find(self.marker, pos)
        if found != pos:
            return _content_step(text, pos, found, self.marker, final, "text")
        start = _SPACE.match(text, pos + len(self.marker)).end()
        call = _object_call(text, start, final)
        if call is _INCOMPLETE:
            return None
        if call is None:  # not a call: the marker is content
            return Step([text[pos:start]], start, "text")
        return Step([call[0]], call[1], "sequence")

    def _next_call(self, text: str, pos: int, final: bool) -> Step | None:
        separator = _SPACE.match(text, pos).end()
        if separator == len(text):
            return Step([text[pos:]], len(text), "text") if final else None
        if text[separator] != ";":
            return Step([], pos, "text")
        call = _object_call(text, _SPACE.match(text, separator + 1).end(), final)
        if call is _INCOMPLETE:
            return None
        if call is None:  # the ";" and what follows are content
            return Step([], pos, "text")
        return Step([call[0]], call[1], "sequence")


_CLOSERS = {"(": ")", "[": "]", "{": "}"}
_PLAIN_CODE = re.compile(r"[^'\"#()\[\]{}]*")  # nothing that opens or closes anything


def _python_string_end(text: str, start: int) -> int | None:
    """The end of the Python string literal opening at ``text[start]``; None if not there yet."""
    quote = text[start]
    # A string that reaches the end of the text may yet become a triple-quoted one; no matter:
    # the list it is in cannot close before more text comes.
    delimiter = quote * 3 if text.startswith(quote * 3, start) else quote
    body = start + len(delimiter)
    found = text.find(delimiter, body)
    while found >= 0:
        escapes = found
        while escapes > body and text[escapes - 1] == "\\":
            escapes -= 1
        if (found - escapes) % 2 == 0:  # not escaped
            return found + len(delimiter)
        found = text.find(delimiter, found + 1)
    return None


def _python_list_end(text: str, start: int) -> int | None:
    """The end of the bracketed Python expression at ``text[start]``: None while it is open,
    -1 if its brackets do not match."""
    closers: list[str] = []
    i = _PLAIN_CODE.match(text, start).end()
    while i < len(text):
        char = text[i]
        if char in "'\"":
            end = _python_string_end(text, i)
            if end is None:
                return None
            i = end
        elif char == "#":  # a comment runs to the end of the line
            i = text.find("\n", i)
            if i < 0:
                return None
        else:
            if char in _CLOSERS:
                closers.append(_CLOSERS[char])
            elif not closers or closers.pop() != char:
                return -1
            elif not closers:
                return i + 1
            i += 1
        i = _PLAIN_CODE.match(text, i).end()
    return None


def _json_value(value: Any) -> Any:
    """A Python literal as a JSON value (tuples become lists); ValueError if it has no JSON form."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float) and math.isfinite(value):
        return value
    if isinstance(value, (list, tuple)):
        return [_json_value(item) for item in value]
    if isinstance(value, dict) and all(isinstance(key, str) for key in value):
        return {key: _json_value(item) for key, item in value.items()}
    raise ValueError(f"{value!r} has no JSON form")


def _pythonic_calls(source: str) -> list[FunctionCall] | None:
    """``[f(x=1), g(s="a")]`` as calls: a list of calls by plain name with literal keywords."""
    try:
        tree = ast.parse(source, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    calls = []
    for node in tree.body.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        arguments = {}
        for keyword in node.keywords:
            if keyword.arg is None:  # **mapping
                return None
            try:
                arguments[keyword.arg] = _json_value(ast.literal_eval(keyword.value))
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                return None
        calls.append(FunctionCall(node.func.id, _dumps(arguments)))
    return calls


def _line_start_bracket(text: str, pos: int, at_line_start: bool) -> int:
    """The first "[" from ``pos`` with only spaces before it on its line, or -1."""
    found = text.find("[", pos)
    while found >= 0:
        newline = text.rfind("\n", pos, found)
        if text[newline + 1 if newline >= 0 else pos : found].strip(" \t") == "" and (
            newline >= 0 or at_line_start
        ):
            return found
        found = text.find("[", found + 1)
    return -1


@register_tool_parser("pythonic")
class PythonicToolParser(ToolParser):
    """The state says whether ``pos`` is at the start of a line (spaces aside)."""

    initial_state = True

    def step(self, text: str, pos: int, state: Hashable, final: bool) -> Step | None:
        start = _line_start_bracket(text, pos, bool(state))
        if start != pos:
            end = start if start >= 0 else len(text)
            content = text[pos:end]
            newline = content.rfind("\n")
            line = content[newline + 1 :] if newline >= 0 else content
            at_line_start = line.strip(" \t") == "" and (newline >= 0 or bool(state))
            return Step([content], end, at_line_start)
        name_at = _SPACE.match(text, pos + 1).end()
        if name_at == len(text) and not final:
            return None
        end = _python_list_end(text, pos) if text[name_at : name_at + 1].isidentifier() else -1
        if end is None and not final:
            return None
        calls = _pythonic_calls(text[pos:end]) if end is not None and end > 0 else None
        if calls is None:  # not a call list: its "[" is content
            return Step(["["], pos + 1, False)
        return Step(list(calls), end, False)
