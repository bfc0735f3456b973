"""Structured output: every token drawn from those that keep the output a valid prefix of a JSON
schema, regex, choice, grammar or structural tag.

Two grammar engines from PyPI: xgrammar and llguidance (``guidance``). ``auto`` uses xgrammar,
and llguidance for a constraint xgrammar cannot build (a Lark grammar, a schema feature it
lacks), unless fallback is off. Both give the same per-step token bitmask (int32, one bit per
vocabulary id), so the engine does not care which one a request has.

Life of a constraint:
- ``check_form`` (in the server, off the event loop, and again in the engine) checks what needs
  no grammar engine: its kind, sizes and choices. xgrammar imports torch, which the server
  process does without.
- ``GrammarCompiler.submit`` (in the engine, ``compiler.py``) compiles it against the
  vocabulary on a small pool of threads, small grammars apart from big ones, cached ones at
  once, choosing the backend on the way (``first_buildable``), so a compile never holds up a
  step nor a cheap grammar an expensive one; the request joins the scheduler once its grammar
  is ready, or ends with an ``InvalidRequestError`` naming its field when no backend can build
  it or it is not ready in time. ``check`` makes the same choice without a vocabulary.
- Per step, ``GrammarStep`` writes the bitmask rows of the requests that sample (on a worker
  thread, while the forward pass runs); ``Grammar.accept`` advances each matcher by its token.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
from dataclasses import replace
from typing import TYPE_CHECKING

from llmrpc.engine.request import InvalidRequestError, StructuredOutputSpec

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "xgrammar", "guidance")
KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "structural_tag")
MAX_CONSTRAINT_CHARS = 262_144  # a schema's JSON text, a regex, a grammar: 256 Ki characters
MAX_CHOICES = 1024


def field_name(spec: StructuredOutputSpec) -> str:
    """The request field a spec came from (gRPC's names: the server maps them to its own)."""
    return (
        "structured_output.choice.choices"
        if spec.kind == "choice"
        else f"structured_output.{spec.kind}"
    )


def check_form(spec: StructuredOutputSpec) -> None:
    """The checks that need no grammar engine (its kind, sizes, choices): cheap, and free of
    torch, which xgrammar imports; ``InvalidRequestError`` naming the field."""
    if spec.kind not in KINDS:
        raise InvalidRequestError("structured_output", f"unknown kind {spec.kind!r}")
    _check_size(spec)


def check(spec: StructuredOutputSpec, backend: str, fallback: bool = True) -> StructuredOutputSpec:
    """``spec`` with the backend that will serve it (``xgrammar`` or ``guidance``); raises
    ``InvalidRequestError`` naming the field when no allowed backend can build it."""
    return first_buildable(spec, backend, fallback, lambda s: _BUILDERS[s.backend](s))[0]


def first_buildable(spec: StructuredOutputSpec, backend: str, fallback: bool, build):
    """``(spec with its backend, build(that spec))`` for the first backend ``build`` succeeds
    with (``auto``: xgrammar, then guidance unless ``fallback`` is off); else an
    ``InvalidRequestError`` naming the field, with the first backend's message."""
    check_form(spec)
    order = {"auto": ("xgrammar", "guidance") if fallback else ("xgrammar",)}.get(
        backend, (backend,)
    )
    first_error = None
    for name in order:
        candidate = replace(spec, backend=name)
        try:
            return candidate, build(candidate)
        except Exception as error:  # noqa: BLE001 - the grammar engine's own message
            first_error = first_error or f"{_message(error)} ({name})"
    raise InvalidRequestError(field_name(spec), f"cannot be used: {first_error}")


def _check_size(spec: StructuredOutputSpec) -> None:
    if spec.kind == "choice":
        if not spec.choices:
            raise InvalidRequestError(field_name(spec), "give at least one choice")
        if len(spec.choices) > MAX_CHOICES:
            raise InvalidRequestError(field_name(spec), f"at most {MAX_CHOICES} choices")
        if any(not choice for choice in spec.choices):
            raise InvalidRequestError(field_name(spec), "a choice must not be empty")
    size = len(spec.value) + sum(map(len, spec.choices))
    if size > MAX_CONSTRAINT_CHARS:
        raise InvalidRequestError(
            field_name(spec), f"at most {MAX_CONSTRAINT_CHARS} characters, got {size}"
        )


def _message(error: Exception) -> str:
    # xgrammar prefixes its messages with a time and a C++ source position
    text = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
    return text.split(": ", 1)[1] if text.startswith("[") and ": " in text else text


# --- what each backend builds from a spec -------------------------------------------------------


def _choice_rule(start: str, choices: tuple[str, ...]) -> str:
    """A grammar whose ``start`` rule is one of ``choices`` (JSON string literals are EBNF's
    and Lark's string literals too: the same escapes)."""
    return f"{start} " + " | ".join(json.dumps(choice) for choice in choices)


_ANY_OBJECT = '{"type": "object"}'


def _xgrammar_build(spec: StructuredOutputSpec, compiler=None):
    """The xgrammar ``Grammar`` (``compiler`` None) or ``CompiledGrammar`` of ``spec``."""
    import xgrammar

    kind, value = spec.kind, spec.value
    if kind in ("json_schema", "json_object"):
        schema = value if kind == "json_schema" else _ANY_OBJECT
        if kind == "json_schema" and (keyword := unenforced_by_xgrammar(json.loads(value))):
            raise ValueError(f"the JSON Schema keyword {keyword!r} is not enforced by xgrammar")
        any_whitespace = spec.any_whitespace and spec.max_whitespace != 0
        options = {
            "any_whitespace": any_whitespace,
            "max_whitespace_cnt": spec.max_whitespace if any_whitespace else None,
            "strict_mode": True,
        }
        if compiler is None:
            return xgrammar.Grammar.from_json_schema(schema, **options)
        return compiler.compile_json_schema(schema, **options)
    if kind == "regex":
        return (
            xgrammar.Grammar.from_regex(value)
            if compiler is None
            else compiler.compile_regex(value)
        )
    if kind == "structural_tag":
        if compiler is None:
            return xgrammar.Grammar.from_structural_tag(value)
        return compiler.compile_structural_tag(value)
    ebnf = _choice_rule("root ::=", spec.choices) if kind == "choice" else value
    return xgrammar.Grammar.from_ebnf(ebnf) if compiler is None else compiler.compile_grammar(ebnf)


# Keywords xgrammar 0.2.8 accepts and does not enforce (measured: a value the keyword forbids
# is accepted whole): with them a schema goes to llguidance, which refuses what it cannot do.
_XGRAMMAR_IGNORES = frozenset({"not", "if", "then", "else"})
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_DATA = ("enum", "const", "default", "examples")


def unenforced_by_xgrammar(schema) -> str | None:
    """The first keyword of ``schema`` (a JSON Schema, as parsed) that xgrammar would ignore:
    one of ``_XGRAMMAR_IGNORES``, or ``allOf`` of more than one schema (xgrammar keeps one)."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        for key, value in node.items():
            if key in _XGRAMMAR_IGNORES or (key == "allOf" and len(value or ()) > 1):
                return key
            if key in _SCHEMA_MAPS and isinstance(value, dict):
                stack.extend(value.values())
            elif key in _SCHEMA_LISTS and isinstance(value, list):
                stack.extend(value)
            elif key not in _DATA and isinstance(value, dict):
                stack.append(value)
    return None


def _closed_objects(schema):
    """``schema`` with ``additionalProperties: false`` on every object schema that does not say."""
    if isinstance(schema, list):
        return [_closed_objects(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {key: _closed_objects(value) for key, value in schema.items()}
    if closed.get("type") == "object" or "properties" in closed:
        closed.setdefault("additionalProperties", False)
    return closed


def _guidance_json_options(spec: StructuredOutputSpec) -> dict:
    """llguidance's JSON options for ``spec``'s whitespace: as xgrammar's, runs of space, tab,
    newline and carriage return of at most ``spec.max_whitespace`` (a schema's own
    ``x-guidance`` options win over these defaults)."""
    flexible = spec.any_whitespace and spec.max_whitespace != 0
    options = {"whitespace_flexible": flexible}
    if flexible and spec.max_whitespace is not None:
        options["whitespace_pattern"] = rf"[\x20\x0A\x0D\x09]{{0,{spec.max_whitespace}}}"
    return options


def _guidance_grammar(spec: StructuredOutputSpec) -> str:
    import llguidance

    kind = spec.kind
    if kind in ("json_schema", "json_object"):
        schema = json.loads(spec.value) if kind == "json_schema" else {"type": "object"}
        if not spec.additional_properties:
            schema = _closed_objects(schema)
        return llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), defaults=_guidance_json_options(spec)
        )
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.value)
    if kind == "choice":
        return llguidance.LLMatcher.grammar_from_lark(_choice_rule("start:", spec.choices))
    if kind == "grammar":
        return llguidance.LLMatcher.grammar_from_lark(spec.value)
    raise ValueError("structural tags need the xgrammar backend")


def _guidance_build(spec: StructuredOutputSpec) -> str:
    import llguidance

    grammar = _guidance_grammar(spec)
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(error)
    return grammar


_BUILDERS = {"xgrammar": _xgrammar_build, "guidance": _guidance_build}


# --- in the engine (compiles: compiler.py) -----------------------------------------


class Grammar:
    """One request's constraint: its compiled grammar (once ready) and its matcher."""

    def __init__(
        self, spec: StructuredOutputSpec, compiled: concurrent.futures.Future, stop_ids
    ) -> None:
        self.spec = spec
        self.compiled = compiled
        self.stop_ids = sorted(stop_ids)
        # Where the output stands: in its answer, held to the grammar ("answer"); in reasoning
        # until it has spec.reasoning_end ("reasoning"); or at its first token, which may open
        # reasoning with spec.reasoning_start or begin the answer ("either").
        self.state = "answer"
        if spec.reasoning_end:
            self.state = "reasoning" if spec.reasoning_start is None else "either"
        self._matcher = None

    @property
    def active(self) -> bool:
        """Whether the grammar holds the next token (alone, or with reasoning's opening)."""
        return self.state != "reasoning"

    @property
    def ready(self) -> bool:
        return self.compiled.done()

    def error(self) -> InvalidRequestError | None:
        """Why the grammar cannot be used (it could not be built), or None; a failure that is
        not the request's own is named ``structured_output`` too."""
        error = self.compiled.exception() if self.ready else None
        if error is None or isinstance(error, InvalidRequestError):
            return error
        return InvalidRequestError("structured_output", f"compiling it failed: {error!r}")

    def _get_matcher(self):
        if self._matcher is None:
            spec, compiled = self.compiled.result()
            if spec.backend == "guidance":
                import llguidance

                tokenizer, grammar = compiled
                matcher = llguidance.LLMatcher(tokenizer, grammar)
                self._matcher = _GuidanceMatcher(matcher, self.stop_ids)
            else:
                import xgrammar

                self._matcher = _XgrammarMatcher(
                    xgrammar.GrammarMatcher(compiled, override_stop_tokens=self.stop_ids)
                )
        return self._matcher

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self._get_matcher().fill(bitmask, row)
        if self.state == "either":
            start = self.spec.reasoning_start
            bitmask[row, start // 32] |= _bit(start % 32)

    def accept(self, output_token_ids: list[int]) -> str | None:
        """Advance by the output's last token; why it broke the grammar, or None."""
        if self.state == "reasoning":
            end = self.spec.reasoning_end
            if tuple(output_token_ids[-len(end) :]) == end:
                self.state = "answer"
            return None
        if self.state == "either":
            opened = output_token_ids[-1] == self.spec.reasoning_start
            self.state = "reasoning" if opened else "answer"
            if opened:
                return None
        matcher = self._get_matcher()
        if matcher.terminated():  # complete; ignore_eos may go on past its stop token
            return None
        token_id = output_token_ids[-1]
        if not matcher.accept(token_id):
            return f"token {token_id} breaks the structured output"
        return None


class _XgrammarMatcher:
    def __init__(self, matcher) -> None:
        self.matcher = matcher

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        return self.matcher.accept_token(token_id)

    def terminated(self) -> bool:
        return self.matcher.is_terminated()


class _GuidanceMatcher:
    def __init__(self, matcher, stop_ids: list[int]) -> None:
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        self.matcher = matcher
        self.stop_ids = stop_ids

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        import llguidance.torch

        if self.matcher.is_stopped():  # complete with nothing left to add: only a stop token
            bitmask[row] = 0
            for token_id in self.stop_ids:
                bitmask[row, token_id // 32] |= _bit(token_id % 32)
            return
        llguidance.torch.fill_next_token_bitmask(self.matcher, bitmask, row)

    def accept(self, token_id: int) -> bool:
        return self.matcher.consume_token(token_id)

    def terminated(self) -> bool:
        return self.matcher.is_stopped()


def _bit(position: int) -> int:
    """Bit ``position`` of an int32 as a Python int (bit 31 is the sign bit)."""
    return -(2**31) if position == 31 else 1 << position
