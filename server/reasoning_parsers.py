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

import inspect
import logging
import os
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable
from typing import NamedTuple, TypeVar

from llmrpc.server.parser_plugins import load_plugin

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


class _LeadingSpace:
    """Holds whitespace at the start of a part until more follows: a part that is only
    whitespace is None in a whole parse, so a stream never sends it."""

    def __init__(self) -> None:
        self._held = ""
        self._open = False

    def release(self, text: str) -> str | None:
        if not self._open:
            self._held += text
            if not self._held.strip():
                return None
            self._open = True
            text, self._held = self._held, ""
        return text or None


class ReasoningStream:
    """The incremental split of one request's output: ``feed`` each new piece, then ``finish``."""

    def __init__(self, parser: ReasoningParser) -> None:
        self._parser = parser
        self._pending = ""  # text not decided yet
        self._state = parser.initial_state
        self._reasoning = _LeadingSpace()
        self._content = _LeadingSpace()
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
        return self._reasoning.release(reasoning), self._content.release(content)


def _opening_end(text: str, pos: int, final: bool) -> int | None:
    """Where a ``<think>`` opening ``text[pos:]`` (after whitespace) ends; -1 if none opens it,
    None while that is undecided."""
    start = _SPACE.match(text, pos).end()
    head = text[start : start + len(OPEN_TAG)]
    if head == OPEN_TAG:
        return start + len(OPEN_TAG)
    return None if not final and OPEN_TAG.startswith(head) else -1


def _held_from(text: str, pos: int, marker: str) -> int:
    """Where the longest end of ``text[pos:]`` that could begin ``marker`` starts (or the end)."""
    for start in range(max(pos, len(text) - len(marker) + 1), len(text)):
        if marker.startswith(text[start:]):
            return start
    return len(text)


def _reasoning_step(text: str, pos: int, final: bool) -> Step | None:
    """Reasoning up to ``</think>``, content after it."""
    close = text.find(CLOSE_TAG, pos)
    if close >= 0:
        return Step(close + len(CLOSE_TAG), "content", reasoning=text[pos:close])
    end = len(text) if final else _held_from(text, pos, CLOSE_TAG)
    return Step(end, "reasoning", reasoning=text[pos:end]) if end > pos else None


_REGISTRY: dict[str, type[ReasoningParser]] = {}
_P = TypeVar("_P", bound=type[ReasoningParser])


def register_reasoning_parser(name: str) -> Callable[[_P], _P]:
    """Class decorator: make a ``ReasoningParser`` subclass available as ``--reasoning-parser``
    ``name``. A later registration of a name replaces the earlier one."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"a reasoning parser name must be a non-empty string, not {name!r}")

    def register(cls: _P) -> _P:
        if not (isinstance(cls, type) and issubclass(cls, ReasoningParser)) or inspect.isabstract(
            cls
        ):
            raise TypeError(f"reasoning parser {name!r}: {cls!r} is not a concrete ReasoningParser")
        if _REGISTRY.get(name, cls) is not cls:
            logger.info("reasoning parser %r: %s replaces %s", name, cls.__name__, _REGISTRY[name])
        _REGISTRY[name] = cls
        return cls

    return register


@register_reasoning_parser("deepseek_r1")
class DeepSeekR1ReasoningParser(ReasoningParser):
    """States: "start" (a ``<think>`` may open the output), "reasoning", "content"."""

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


def get_reasoning_parser(name: str) -> ReasoningParser:
    """The parser registered as ``name``; ValueError naming the known ones if there is none."""
    if name not in _REGISTRY:
        known = ", ".join(reasoning_parser_names())
        raise ValueError(f"--reasoning-parser: unknown reasoning parser {name!r} (known: {known})")
    return _REGISTRY[name]()


def reasoning_parser_names() -> list[str]:
    return sorted(_REGISTRY)


def load_reasoning_parser_plugin(path: str | os.PathLike[str]) -> list[str]:
    """Import the Python file at ``path``, which registers parsers with
    ``register_reasoning_parser``; returns the names it registered (ValueError if it cannot be
    imported; the registry is then as it was)."""
    return load_plugin(path, _REGISTRY, "--reasoning-parser-plugin")
