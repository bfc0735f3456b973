"""JSON request bodies as the gateway reads them: RFC 8259 JSON, valid Unicode, parsed off the
event loop when large.

Python's parser takes ``NaN`` and ``Infinity``, which are not JSON, and a lone surrogate escape
(``"\\ud800"``), which is JSON but no character: protobuf strings must be UTF-8, so such a
string could never reach the gRPC API. Both are 400s naming the parameter that holds them.
Parsing and validating are linear in the body's size; above ``OFF_LOOP_BYTES`` both run on a
worker thread, so the event loop (``/health``, the streams in flight) is not queued behind them.
CPython's JSON parser and pydantic hold the GIL while they run, so above ``OFF_PROCESS_BYTES``
the parsing moves to a process of its own (``parser_process``).
"""

from __future__ import annotations

import asyncio
import json
import re

from fastapi import Request
from fastapi.routing import APIRoute
from pydantic import TypeAdapter, ValidationError

from llmrpc.gateway.errors import invalid, validation_failed
from llmrpc.gateway.parser_process import OFF_PROCESS_BYTES, parse_elsewhere
from llmrpc.gateway.state import gateway_of

OFF_LOOP_BYTES = 64 * 1024  # about a millisecond of parsing; above, a thread's hop is cheaper

# In the raw body: an escape of a surrogate half, paired or not (pairs are common: emoji sent
# by ensure_ascii encoders). Raw UTF-8 cannot carry one, so without it no check is needed.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
# In a parsed string: pairs became one character, so any half left is a lone one.
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


class _NotJson(float):
    """What the parser made of ``NaN``/``Infinity``; found and refused by ``_problem``."""

    def __new__(cls, name: str) -> _NotJson:
        value = super().__new__(cls, name)
        value.name = name
        return value


def _problem(document) -> tuple[str | None, str] | None:
    """(parameter, what is wrong) for the first bad value, in document order; None if none.
    Iterative: a deeply nested body must not exhaust the stack."""
    stack = [(None, document)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if _LONE_SURROGATE.search(value):
                return path, "contains a lone UTF-16 surrogate escape, which is no character"
        elif isinstance(value, _NotJson):
            return path, f"{value.name} is not a JSON number: numbers must be finite"
        elif isinstance(value, list):
            stack.extend(
                (f"{path or ''}[{i}]", item) for i, item in reversed(list(enumerate(value)))
            )
        elif isinstance(value, dict):
            for key in value:
                if _LONE_SURROGATE.search(key):
                    return path, "has a key with a lone UTF-16 surrogate escape"
            children = [(f"{path}.{key}" if path else key, item) for key, item in value.items()]
            stack.extend(reversed(children))
    return None


def parse(body: bytes):
    """The body's JSON; ``OpenAIError`` (400) for anything the gateway cannot pass on."""
    constants: list[str] = []

    def not_json(name: str) -> _NotJson:
        constants.append(name)
        return _NotJson(name)

    try:
        document = json.loads(body, parse_constant=not_json)
    except (ValueError, RecursionError) as error:  # UnicodeDecodeError is a ValueError
        raise invalid(None, f"the request body is not valid JSON: {error}") from None
    if constants or _SURROGATE_ESCAPE.search(body):
        found = _problem(document)
        if found is not None:
            param, what = found
            raise invalid(param, f"{param}: {what}" if param else f"the body {what}")
    return document


def parse_and_validate(body: bytes, adapter: TypeAdapter | None):
    """``parse``, then the route's body model (FastAPI accepts the instance as it is)."""
    return validate(parse(body), adapter)


def validate(document, adapter: TypeAdapter | None):
    if adapter is None:
        return document
    try:
        return adapter.validate_python(document)
    except ValidationError as error:
        raise validation_failed(list(error.errors())) from None


class JsonRequest(Request):
    """A request whose ``json()`` is ``parse``; a large body is also validated against the
    route's model, both on a worker thread."""

    def __init__(self, scope, receive, adapter: TypeAdapter | None) -> None:
        super().__init__(scope, receive)
        self._adapter = adapter

    async def json(self):
        if not hasattr(self, "_json"):
            body = await self.body()
            if len(body) > OFF_PROCESS_BYTES:
                self._json = await self._parse_elsewhere(body)
            elif len(body) > OFF_LOOP_BYTES:
                self._json = await asyncio.to_thread(parse_and_validate, body, self._adapter)
            else:
                self._json = parse(body)
        return self._json

    async def _parse_elsewhere(self, body: bytes):
        max_items = await gateway_of(self).max_list_items()
        outcome = await parse_elsewhere(body, max_items)
        if outcome[0] == "error":
            raise invalid(outcome[1], outcome[2])
        return await asyncio.to_thread(validate, outcome[1], self._adapter)


class JsonRoute(APIRoute):
    """A route whose body is read through ``JsonRequest``."""

    def get_route_handler(self):
        handler = super().get_route_handler()
        model = self.body_field.field_info.annotation if self.body_field else None
        adapter = TypeAdapter(model) if model is not None else None

        async def route_handler(request: Request):
            return await handler(JsonRequest(request.scope, request.receive, adapter))

        return route_handler
