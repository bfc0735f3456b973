"""A GenerateRequest's ``structured_output`` -> the engine's ``StructuredOutputSpec``, checked.

The check builds the grammar (without the vocabulary, which only the engine compiles against),
so a bad schema, regex or grammar is INVALID_ARGUMENT naming its field before the request takes
a place in the queue. It runs where the request is converted: off the event loop.
"""

from __future__ import annotations

import json

from google.protobuf import json_format

from llmrpc.engine import structured_output
from llmrpc.engine.config import StructuredOutputConfig
from llmrpc.engine.request import InvalidRequestError, StructuredOutputSpec
from llmrpc.v1 import common_pb2

_KINDS = ", ".join(structured_output.KINDS)


def _integral_floats_as_ints(value):
    """A Struct's numbers are all doubles: ``"maxLength": 5.0`` back to ``5`` (the same JSON
    number, but a grammar engine may want an integer there)."""
    if isinstance(value, dict):
        return {key: _integral_floats_as_ints(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_integral_floats_as_ints(item) for item in value]
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    return value


def struct_json(struct) -> str:
    """A ``google.protobuf.Struct`` as JSON text, integral numbers written as integers."""
    return json.dumps(_integral_floats_as_ints(json_format.MessageToDict(struct)))


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
        value = struct_json(message.json_schema)
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
        reasoning_end=reasoning_end,
    )
    return structured_output.check(spec, config.backend, not config.disable_fallback)
