"""Reasoning parsers: a model's output split into ``reasoning_content`` and ``content``.

``--reasoning-parser NAME`` names how the model marks its thinking, ``<think>`` ... ``</think>``:

- ``deepseek_r1``: the chat template has already opened the think block, so the output starts in
  reasoning and turns to content after the first ``</think>``. A ``<think>`` opening the output
  (whitespace before it aside) is dropped. Without ``</think>`` all of the output is reasoning.
- ``qwen3``: reasoning only where the output marks it. Output opening with ``<think>`` reasons up
  to the first ``</think>`` (to the end, without one). Other output with a ``</think>``: what
  precedes it is reasoning, or, when a ``<think>`` comes before it, what lies between the two (text
  before that ``<think>`` is content). Without ``</think>`` all of it is content, any ``<think>``
  included as written.

Tags that mark reasoning appear in neither part; text after the first ``</think>`` is content as
written. ``parse(text)`` returns ``(reasoning, content)``, each None when empty or whitespace only.
``stream()`` gives a per-request ``ReasoningStream``: ``feed(delta_text)`` and ``finish()`` return
``(reasoning_delta, content_delta)``, each None when there is none. For any split of the text the
deltas concatenate to what ``parse`` returns. A possible partial tag at the end of a delta is held
back until decided; qwen3 output that does not open with ``<think>`` is held until a tag decides
it or the output ends, since until then it may still turn out to be reasoning.

Plugins: ``load_reasoning_parser_plugin(path)`` imports a Python file that registers parsers with
``@register_reasoning_parser("name")`` (``--reasoning-parser-plugin``).
"""

from __future__ import annotations

import logging
import re
from abc import ABC, abstractmethod
from collections.abc import Hashable
from typing import NamedTuple

from llmrpc.server.parser_registry import LeadingSpace, ParserRegistry, held_from

logger = logging.getLogger(__name__)

OPEN_TAG = "<think>"
CLOSE_TAG = "</think>"
_SPACE = re.compile(r"\s*")
_LEADING_OPEN = re.compile(r"\s*" + re.escape(OPEN_TAG))


def _part(text: str) -> str | None:
    return text if text.strip() else None


class Step(NamedTuple):
    """What a parser decided: the text up to ``pos`` is ``reasoning`` and ``content``."""

    pos: int
    state: Hashable
    reasoning: str = ""
    content: str = ""


class ReasoningParser(ABC):
    """One way of marking reasoning. Stateless: a request's progress lives in its stream.

    ``step`` reads ``text`` from ``pos`` (text before it may be gone) in ``state``. When ``final``
    is false more text may follow: decide only what no continuation could change, and return None
    when nothing is decided. Each step moves ``pos`` or changes ``state``. ``parse`` defaults to
    stepping through the whole text.
    """

    initial_state: Hashable = "start"
    # For structured output, which holds the answer alone: the tags, and whether an output
    # starts in reasoning (the chat template opened it) or may open it with open_tag.
    open_tag: str = OPEN_TAG
    close_tag: str = CLOSE_TAG
    starts_in_reasoning: bool = False

    @abstractmethod
    def step(self, text: str, pos: int, state: Hashable, final: bool) -> Step | None: ...

    def parse(self, text: str) -> tuple[str | None, str | None]:
        reasoning, content, _, _ = self.scan(text, self.initial_state, final=True)
        return _part(reasoning), _part(content)

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self)

    def scan(self, text: str, state: Hashable, final: bool) -> tuple[str, str, int, Hashable]:
        """Steps from the start of ``text``: the reasoning and content decided, their end, state."""
        reasoning, content, pos = [], [], 0
        while pos < len(text):
            step = self.step(text, pos, state, final)
            if step is None:
                if not final:
                    break
                step = Step(len(text), state, content=text[pos:])  # undecided at the end
            if step.pos < pos or (step.pos, step.state) == (pos, state):
                raise RuntimeError(f"{type(self).__name__}.step made no progress at {pos}")
            reasoning.append(step.reasoning)
            content.append(step.content)
            pos, state = step.pos, step.state
        return "".join(reasoning), "".join(content), pos, state


class ReasoningStream:
    """The incremental split of one request's output: ``feed`` each new piece, then ``finish``."""

    def __init__(self, parser: ReasoningParser) -> None:
        self._parser = parser
        self._pending = ""  # text not decided yet
        self._state = parser.initial_state
        self._reasoning = LeadingSpace()
        self._content = LeadingSpace()
        self._finished = False

    def feed(self, delta_text: str) -> tuple[str | None, str | None]:
        if self._finished:
            raise RuntimeError("ReasoningStream.feed after finish")
        self._pending += delta_text
        return self._advance(final=False)

    def finish(self) -> tuple[str | None, str | None]:
        if self._finished:
            return None, None
        self._finished = True
        return self._advance(final=True)

    def _advance(self, final: bool) -> tuple[str | None, str | None]:
        reasoning, content, pos, self._state = self._parser.scan(self._pending, self._state, final)
        self._pending = self._pending[pos:]
        return (
            self._reasoning.release(reasoning) or None,
            self._content.release(content) or None,
        )


def _opening_end(text: str, pos: int, final: bool) -> int | None:
    """Where a ``<think>`` opening ``text[pos:]`` (after whitespace) ends; -1 if none opens it,
    None while that is undecided."""
    start = _SPACE.match(text, pos).end()
    head = text[start : start + len(OPEN_TAG)]
    if head == OPEN_TAG:
        return start + len(OPEN_TAG)
    return None if not final and OPEN_TAG.startswith(head) else -1


def _reasoning_step(text: str, pos: int, final: bool) -> Step | None:
    """Reasoning up to ``</think>``, content after it."""
    close = text.find(CLOSE_TAG, pos)
    if close >= 0:
        return Step(close + len(CLOSE_TAG), "content", reasoning=text[pos:close])
    end = len(text) if final else held_from(text, pos, CLOSE_TAG)
    return Step(end, "reasoning", reasoning=text[pos:end]) if end > pos else None


REGISTRY: ParserRegistry[type[ReasoningParser]] = ParserRegistry(
    ReasoningParser, "reasoning parser", "--reasoning-parser", "--reasoning-parser-plugin"
)
register_reasoning_parser = REGISTRY.register
get_reasoning_parser = REGISTRY.get
reasoning_parser_names = REGISTRY.names
load_reasoning_parser_plugin = REGISTRY.load_plugin


@register_reasoning_parser("deepseek_r1")
class DeepSeekR1ReasoningParser(ReasoningParser):
    """States: "start" (a ``<think>`` may open the output), "reasoning", "content"."""

    starts_in_reasoning = True

    def step(self, text: str, pos: int, state: Hashable, final: bool) -> Step | None:
        if state == "start":
            end = _opening_end(text, pos, final)
            if end is None:
                return None
            return Step(end if end >= 0 else pos, "reasoning")
        if state == "reasoning":
            return _reasoning_step(text, pos, final)
        return Step(len(text), "content", content=text[pos:])

    def parse(self, text: str) -> tuple[str | None, str | None]:
        opening = _LEADING_OPEN.match(text)
        body = text[opening.end() :] if opening else text
        reasoning, _, content = body.partition(CLOSE_TAG)
        return _part(reasoning), _part(content)


@register_reasoning_parser("qwen3")
class Qwen3ReasoningParser(ReasoningParser):
    """States: "start", "reasoning" (the output opened with ``<think>``), "undecided" (it did
    not), "opened" (at a later ``<think>``), "content"."""

    def step(self, text: str, pos: int, state: Hashable, final: bool) -> Step | None:
        if state == "start":
            end = _opening_end(text, pos, final)
            if end is None:
                return None
            return Step(end, "reasoning") if end >= 0 else Step(pos, "undecided")
        if state == "reasoning":
            return _reasoning_step(text, pos, final)
        if state == "undecided":
            return self._undecided(text, pos, final)
        if state == "opened":
            close = text.find(CLOSE_TAG, pos + len(OPEN_TAG))
            if close >= 0:
                reasoning = text[pos + len(OPEN_TAG) : close]
                return Step(close + len(CLOSE_TAG), "content", reasoning=reasoning)
            return Step(len(text), "content", content=text[pos:]) if final else None
        return Step(len(text), "content", content=text[pos:])

    def _undecided(self, text: str, pos: int, final: bool) -> Step | None:
        opening, close = text.find(OPEN_TAG, pos), text.find(CLOSE_TAG, pos)
        if opening >= 0 and (close < 0 or opening < close):
            return Step(opening, "opened", content=text[pos:opening])
        if close >= 0:
            return Step(close + len(CLOSE_TAG), "content", reasoning=text[pos:close])
        return Step(len(text), "content", content=text[pos:]) if final else None

    def parse(self, text: str) -> tuple[str | None, str | None]:
        opening = _LEADING_OPEN.match(text)
        if opening:
            reasoning, _, content = text[opening.end() :].partition(CLOSE_TAG)
            return _part(reasoning), _part(content)
        open_at, close_at = text.find(OPEN_TAG), text.find(CLOSE_TAG)
        after = text[close_at + len(CLOSE_TAG) :]
        if close_at < 0:
            return None, _part(text)
        if 0 <= open_at < close_at:
            return _part(text[open_at + len(OPEN_TAG) : close_at]), _part(text[:open_at] + after)
        return _part(text[:close_at]), _part(after)
