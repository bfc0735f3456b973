"""JSON request bodies as the gateway reads them: RFC 8259 JSON, valid Unicode, parsed off the
event loop when large.

Python's parser takes ``NaN`` and ``Infinity``, which are not JSON, and a lone surrogate escape
(``"\\ud800"``), which is JSON but no character: protobuf strings must be UTF-8, so such a
string could never reach the gRPC API. Both are 400s naming the parameter that holds them.
Parsing and validating are linear in the body's size, and its shape is bounded before
validation (keys per object, nesting, ``logit_bias`` entries: ``json_bounds``); above
``OFF_LOOP_BYTES`` both run on a worker thread, so the event loop (``/health``, the streams in
flight) is not queued behind them. CPython's JSON parser and pydantic hold the GIL while they
run, so above ``OFF_PROCESS_BYTES`` parsing and validating move to a process of their own
(``parser_process``), and only the validated request comes back.
"""

from __future__ import annotations

import asyncio
import json
import re

from fastapi import Request
from fastapi.routing import APIRoute
from pydantic import TypeAdapter, ValidationError

from llmrpc.gateway.errors import invalid, validation_failed
from llmrpc.gateway.json_bounds import NotJson, first_problem
from llmrpc.gateway.parser_process import OFF_PROCESS_BYTES, parse_elsewhere
from llmrpc.gateway.request_fields import IGNORED, STRICT
from llmrpc.gateway.state import gateway_of

OFF_LOOP_BYTES = 64 * 1024  # about a millisecond of parsing; above, a thread's hop is cheaper

# In the raw body: an escape of a surrogate half, paired or not (pairs are common: emoji sent
# by ensure_ascii encoders). Raw UTF-8 cannot carry one, so without it no check is needed.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def parse(body: bytes, max_items: int | None = None):
    """The body's JSON; ``OpenAIError`` (400) for anything the gateway cannot pass on, or past
    the bounds of ``json_bounds``."""
    constants: list[str] = []

    def not_json(name: str) -> NotJson:
        constants.append(name)
        return NotJson(name)

    try:
        document = json.loads(body, parse_constant=not_json)
    except (ValueError, RecursionError) as error:  # UnicodeDecodeError is a ValueError
        raise invalid(None, f"the request body is not valid JSON: {error}") from None
    check_values = bool(constants) or _SURROGATE_ESCAPE.search(body) is not None
    found = first_problem(document, max_items, check_values)
    if found is not None:
        raise invalid(*found)
    return document


def parse_and_validate(body: bytes, adapter: TypeAdapter | None, max_items: int | None = None):
    """``parse``, then the route's body model (FastAPI accepts the instance as it is)."""
    return validate(parse(body, max_items), adapter)


def validate(document, adapter: TypeAdapter | None):
    if adapter is None:
        return document
    try:
        return adapter.validate_python(document)
    except ValidationError as error:
        raise validation_failed(list(error.errors())) from None


class JsonRequest(Request):
    """A request whose ``json()`` is ``parse``; a large body is also validated against the
    route's model, both on a worker thread, or for the largest both in the parser process,
    which sends back only the validated request."""

    def __init__(self, scope, receive, model, adapter: TypeAdapter | None) -> None:
        super().__init__(scope, receive)
        self._model = model
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
        outcome = await parse_elsewhere(body, max_items, self._model, STRICT.get())
        if outcome[0] == "error":
            raise invalid(outcome[1], outcome[2])
        ignored = IGNORED.get()
        if ignored is not None:  # the names that process dropped, logged as this request's
            ignored.extend(outcome[2])
        return outcome[1]


class JsonRoute(APIRoute):
    """A route whose body is read through ``JsonRequest``."""

    def get_route_handler(self):
        handler = super().get_route_handler()
        model = self.body_field.field_info.annotation if self.body_field else None
        adapter = TypeAdapter(model) if model is not None else None

        async def route_handler(request: Request):
            return await handler(JsonRequest(request.scope, request.receive, model, adapter))

        return route_handler
