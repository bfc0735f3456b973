"""Chat outputs read for reasoning and tool calls on their way out (``GenerateResponse``'s
``reasoning_text`` and ``tool_calls``).

Only chat requests are read. Under ``--reasoning-parser`` each sample's text is split first: the
reasoning goes to ``reasoning_text``, and only the rest (the answer) is read for calls. With
tools and tool_choice AUTO, ``--tool-call-parser`` reads the answer: ``text`` keeps the content
outside the calls. Under tool_choice REQUIRED or a named function the answer is JSON held to a
schema (``tool_calling``): it becomes the calls once complete; cut short (by max_tokens), a named
function's call takes the arguments written so far, as vLLM's does, and REQUIRED's array stays
content. Streams keep one parser state per sample index: content deltas come
as the parser releases them, and each call comes once, whole, in the message where its text
completes, with its index. Malformed calls are content, never errors.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from llmrpc.server import reasoning_parsers, tool_parsers
from llmrpc.server.errors import InvalidArgument
from llmrpc.server.reasoning_parsers import ReasoningParser, ReasoningStream
from llmrpc.server.settings import ParsingConfig
from llmrpc.server.tool_calling import (
    ToolMode,
    ToolPlan,
    forced_calls,
    forced_schema,
    tool_plan,
)
from llmrpc.server.tool_parsers import ContentDelta, FunctionCall, ToolCallStream, ToolParser
from llmrpc.v1 import common_pb2, generation_pb2

logger = logging.getLogger(__name__)

# Plugin files imported so far, per registry: loading a configuration twice (the flags are
# checked, then the server is built) imports each file once.
_LOADED_PLUGINS: set[tuple[str, Path]] = set()


def _load_plugin(registry, path: str) -> None:
    if not path:
        return
    key = (registry.plugin_flag, Path(path).resolve())
    if key in _LOADED_PLUGINS:
        return
    names = registry.load_plugin(path)
    _LOADED_PLUGINS.add(key)
    logger.info("%s %s registered: %s", registry.plugin_flag, path, ", ".join(names) or "nothing")


@dataclass(frozen=True)
class OutputParsers:
    """The server's parsers (stateless; each request streams with a state of its own)."""

    tool_parser: ToolParser | None = None
    reasoning_parser: ReasoningParser | None = None
    auto_tool_choice: bool = False
    exclude_tools_when_tool_choice_none: bool = False

    @classmethod
    def from_config(cls, config: ParsingConfig) -> OutputParsers:
        """Loads the plugins, then the named parsers; ValueError naming the flag."""
        _load_plugin(tool_parsers.REGISTRY, config.tool_parser_plugin)
        _load_plugin(reasoning_parsers.REGISTRY, config.reasoning_parser_plugin)
        tool_parser = None
        if config.tool_call_parser:
            tool_parser = tool_parsers.get_tool_parser(config.tool_call_parser)
        reasoning_parser = None
        if config.reasoning_parser:
            reasoning_parser = reasoning_parsers.get_reasoning_parser(config.reasoning_parser)
        return cls(
            tool_parser,
            reasoning_parser,
            config.enable_auto_tool_choice and tool_parser is not None,
            config.exclude_tools_when_tool_choice_none,
        )

    def new_call_id(self) -> str:
        """An id for a forced call, in the form the model's parser uses (Mistral's 9
        alphanumerics, say); else OpenAI's ``call_...``."""
        if self.tool_parser is not None:
            return self.tool_parser.new_call_id()
        return tool_parsers.random_call_id()


@dataclass(frozen=True)
class OutputPlan:
    """How one chat request's outputs are read."""

    parsers: OutputParsers
    tools: ToolPlan = field(default_factory=ToolPlan)


def plan_request(request, parsers: OutputParsers) -> OutputPlan | None:
    """The checked plan of a GenerateRequest's outputs; None when nothing is read (not chat)."""
    if request.WhichOneof("input") != "chat":
        return None
    return OutputPlan(parsers, tool_plan(request.chat, parsers.auto_tool_choice))


def prepared_request(request, plan: OutputPlan | None):
    """``request`` as the engine should see it: without its tools under tool_choice none when
    the server excludes them, with the forced calls' schema as its structured output. A copy
    when anything changes (the caller's message is left alone)."""
    if plan is None:
        return request
    tools = plan.tools
    exclude = tools.mode is ToolMode.NONE and plan.parsers.exclude_tools_when_tool_choice_none
    if not (tools.forced or (exclude and request.chat.tools)):
        return request
    if tools.forced and request.HasField("structured_output"):
        raise InvalidArgument(
            "structured_output",
            "cannot be combined with chat.tool_choice required or a function: those hold the "
            "output to the tools' schemas themselves",
        )
    prepared = generation_pb2.GenerateRequest()
    prepared.CopyFrom(request)
    if tools.forced:
        prepared.structured_output.json_schema = json.dumps(forced_schema(request.chat, tools))
    if exclude:
        del prepared.chat.tools[:]
    return prepared


def prepared_tokenize_request(request, parsers: OutputParsers):
    """A TokenizeRequest's chat checked, and rendered as generation would render it."""
    if request.WhichOneof("input") != "chat":
        return request
    plan = OutputPlan(parsers, tool_plan(request.chat, None))
    if not (plan.tools.mode is ToolMode.NONE and parsers.exclude_tools_when_tool_choice_none):
        return request
    prepared = type(request)()
    prepared.CopyFrom(request)
    del prepared.chat.tools[:]
    return prepared


# --- reading outputs --------------------------------------------------------------------------


@dataclass
class Parsed:
    """What one piece of a sample's text turned out to be."""

    content: str = ""
    reasoning: str = ""
    calls: list[common_pb2.ToolCall] = field(default_factory=list)


def _call_proto(call_id: str, call: FunctionCall, index: int) -> common_pb2.ToolCall:
    function = common_pb2.FunctionCall(name=call.name, arguments=call.arguments)
    return common_pb2.ToolCall(id=call_id, type="function", function=function, index=index)


class SampleParser:
    """One sample's text, piece by piece (``final`` with the last piece)."""

    def __init__(self, plan: OutputPlan) -> None:
        self._plan = plan
        parsers = plan.parsers
        reasoning = parsers.reasoning_parser
        self._reasoning: ReasoningStream | None = reasoning.stream() if reasoning else None
        self._tools: ToolCallStream | None = None
        if plan.tools.mode is ToolMode.AUTO and parsers.tool_parser is not None:
            self._tools = parsers.tool_parser.stream()
        self._held: list[str] = []  # forced calls: the answer, read once complete
        self._open: dict[int, common_pb2.ToolCall] = {}  # calls by index, as their deltas come

    def feed(self, text: str, final: bool) -> Parsed:
        reasoning, content = self._split(text, final)
        parsed = Parsed(reasoning=reasoning)
        if self._plan.tools.forced:
            self._held.append(content)
            if final:
                self._read_forced("".join(self._held), parsed)
        elif self._tools is not None:
            self._read_calls(content, final, parsed)
        else:
            parsed.content = content
        if not self._plan.tools.parallel:  # as vLLM: the first call alone
            parsed.calls = [call for call in parsed.calls if call.index == 0]
        return parsed

    def _split(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, answer) of this piece."""
        if self._reasoning is None:
            return "", text
        reasoning, content = self._reasoning.feed(text) if text else (None, None)
        if final:
            more_reasoning, more_content = self._reasoning.finish()
            reasoning = (reasoning or "") + (more_reasoning or "")
            content = (content or "") + (more_content or "")
        return reasoning or "", content or ""

    def _read_forced(self, text: str, parsed: Parsed) -> None:
        tools = self._plan.tools
        calls = forced_calls(text, tools)
        if calls is None and tools.mode is ToolMode.NAMED:  # cut short: what it wrote, as vLLM
            calls = [FunctionCall(tools.function_name, text)]
        if calls is None:
            logger.info("a forced tool call's output did not parse; it is returned as content")
            parsed.content = text
            return
        new_id = self._plan.parsers.new_call_id
        parsed.calls = [_call_proto(new_id(), call, i) for i, call in enumerate(calls)]

    def _read_calls(self, text: str, final: bool, parsed: Parsed) -> None:
        deltas = self._tools.feed(text) if text else []
        if final:
            deltas += self._tools.finish()
        content, touched = [], []
        for delta in deltas:
            if isinstance(delta, ContentDelta):
                content.append(delta.text)
                continue
            call = self._open.get(delta.index)
            if call is None:  # a call's first delta: its id and name
                call = _call_proto(delta.id, FunctionCall(delta.function.name or "", ""), 0)
                call.index = delta.index
                self._open[delta.index] = call
                touched.append(call)
            call.function.arguments += delta.function.arguments
        parsed.content = "".join(content)
        parsed.calls = touched


def _fill(response, parsed: Parsed) -> None:
    response.text = parsed.content
    response.reasoning_text = parsed.reasoning
    del response.tool_calls[:]
    response.tool_calls.extend(parsed.calls)


class ResponseParsing:
    """The reading of one request's responses: each sample has its own parser."""

    def __init__(self, plan: OutputPlan) -> None:
        self._plan = plan
        self._samples: dict[int, SampleParser] = {}

    def stream(self, response: generation_pb2.GenerateResponse) -> None:
        """A streamed message, rewritten in place."""
        sample = self._samples.get(response.index)
        if sample is None:
            sample = self._samples[response.index] = SampleParser(self._plan)
        final = response.finish_reason != generation_pb2.FINISH_REASON_UNSPECIFIED
        _fill(response, sample.feed(response.text, final))

    def unary(self, response: generation_pb2.GenerateResponse) -> None:
        """A whole response, rewritten in place (its top level is sample 0, the same calls)."""
        samples = list(response.samples) or [response]
        parsed = {s.index: SampleParser(self._plan).feed(s.text, final=True) for s in samples}
        for sample in samples:
            _fill(sample, parsed[sample.index])
        if response.samples:
            _fill(response, parsed[response.index])
