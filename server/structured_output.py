"""A GenerateRequest's ``structured_output`` -> the engine's ``StructuredOutputSpec``.

Here its form is checked (kind, sizes, choices); the grammar itself is built by the engine,
with its compile, off the engine's step: xgrammar imports torch, which this process does
without. A schema, regex or grammar that cannot be built ends the request before it is queued,
as INVALID_ARGUMENT naming its field (``convert.engine_failure``).
"""

from __future__ import annotations

import json
from dataclasses import replace

from llmrpc.engine.config import StructuredOutputConfig
from llmrpc.engine.request import InvalidRequestError, StructuredOutputSpec
from llmrpc.engine.structured_output import grammar as structured_output
from llmrpc.v1 import common_pb2

_KINDS = ", ".join(structured_output.KINDS)


def _check_json_object(text: str, field: str) -> None:
    if len(text) > structured_output.MAX_CONSTRAINT_CHARS:
        return  # check_form refuses it by its size, before parsing it
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as error:
        raise InvalidRequestError(field, f"not JSON: {error}") from None
    if not isinstance(value, dict | bool):
        raise InvalidRequestError(field, "a JSON schema is an object (or true or false)")


def _option(message: common_pb2.StructuredOutput, name: str, default: bool) -> bool:
    return getattr(message, name) if message.HasField(name) else default


def engine_spec(
    message: common_pb2.StructuredOutput,
    config: StructuredOutputConfig,
    reasoning_end: tuple[int, ...] = (),
) -> StructuredOutputSpec:
    """The checked spec of a set ``structured_output``; raises ``InvalidRequestError`` naming
    the field."""
    kind = message.WhichOneof("kind")
    if kind is None:
        raise InvalidRequestError("structured_output", f"set one of {_KINDS}")
    value, choices = "", ()
    if kind == "json_schema":
        value = message.json_schema
        _check_json_object(value, "structured_output.json_schema")
    elif kind == "json_object":
        if not message.json_object:
            raise InvalidRequestError(
                "structured_output.json_object", "set it to true (or leave structured_output unset)"
            )
    elif kind == "choice":
        choices = tuple(message.choice.choices)
    else:
        value = getattr(message, kind)
    spec = StructuredOutputSpec(
        kind,
        value,
        choices,
        any_whitespace=not _option(
            message, "disable_any_whitespace", config.disable_any_whitespace
        ),
        additional_properties=not _option(
            message, "disable_additional_properties", config.disable_additional_properties
        ),
        max_whitespace=config.max_whitespace,
        reasoning_end=reasoning_end,
    )
    structured_output.check_form(spec)
    return spec


def _last_at(ids: list[int], part: tuple[int, ...]) -> int:
    """Where ``part`` last occurs in ``ids`` (-1: nowhere)."""
    size = len(part)
    if not size:
        return -1
    for start in range(len(ids) - size, -1, -1):
        if ids[start] == part[0] and tuple(ids[start : start + size]) == part:
            return start
    return -1


def after_reasoning(
    spec: StructuredOutputSpec, prompt: list[int], tokenizer, parser
) -> StructuredOutputSpec:
    """``spec`` holding the answer alone under a reasoning ``parser``: from the start when the
    prompt has closed the reasoning (a template with thinking turned off writes an empty think
    block); after the close tag when the output starts in reasoning (the parser says so, or
    the prompt opened it); else the first token may open reasoning with the open tag, where
    that tag is one token (a model without such a token does not think in tags)."""
    close = tuple(tokenizer.encode(parser.close_tag, add_special_tokens=False))
    opened = tuple(tokenizer.encode(parser.open_tag, add_special_tokens=False))
    closed_at, opened_at = _last_at(prompt, close), _last_at(prompt, opened)
    if closed_at > opened_at:
        return spec
    if parser.starts_in_reasoning or opened_at >= 0:
        return replace(spec, reasoning_end=close)
    if len(opened) == 1:
        return replace(spec, reasoning_end=close, reasoning_start=opened[0])
    return spec
