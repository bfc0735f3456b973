"""Request fields the gateway does not know, as vLLM treats them or stricter.

A request object (``StrictModel``) names every field it takes. A field it does not name is, by
default, dropped and logged (one warning a name, again at most every ``LOG_INTERVAL_S``), as
vLLM ignores them: a client updated for a new OpenAI field keeps working. Under
``--strict-request-fields`` it is a 400 naming it, so a typo cannot pass as if honoured. A field
sent as null asks for nothing and is dropped either way. Fields the gateway knows and cannot
honour are declared and refused where they are declared, whatever this says.

The policy is the request's: ``UnknownFieldsMiddleware`` sets it, and a list collecting the
dropped names, in context variables before the body is read, which the validation on the event
loop and on a worker thread see; the parser process is handed the policy and sends the names
back (``parser_process``). The middleware logs them as the response starts.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

logger = logging.getLogger(__name__)

# The 400 names one (an error apiece would cost a millisecond a 100); a request logs as many.
MAX_UNKNOWN_REPORTED = 16
LOG_INTERVAL_S = 600.0
MAX_LOGGED_NAMES = 256  # names remembered for the interval: a client's made-up names cost no more

# Outside a request (a model validated by code of ours): unknown fields are errors.
STRICT: contextvars.ContextVar[bool] = contextvars.ContextVar("strict_fields", default=True)
IGNORED: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar(
    "ignored_fields", default=None
)


@functools.cache
def _known_names(model: type[BaseModel]) -> frozenset[str]:
    """A request object's field names and aliases (once a class: a chat's messages ask each)."""
    fields = model.model_fields
    return frozenset(fields) | {info.alias for info in fields.values() if info.alias}


def _unknown_fields(model: type[BaseModel], data: Any) -> Any:
    """``data`` without the fields ``model`` does not declare (noted in ``IGNORED``), or a 400
    naming them where the request is strict."""
    if not isinstance(data, dict):
        return data
    known = _known_names(model)
    if any(name not in known and value is None for name, value in data.items()):
        data = {name: value for name, value in data.items() if name in known or value is not None}
    unknown = [name for name in data if name not in known]
    if not unknown:
        return data
    if not STRICT.get():
        ignored = IGNORED.get()
        if ignored is not None:  # a request's first few names: logging costs no more per name
            ignored.extend(unknown[: MAX_UNKNOWN_REPORTED - len(ignored)])
        return {name: value for name, value in data.items() if name in known}
    errors = [
        InitErrorDetails(
            type=PydanticCustomError(
                "extra_forbidden",
                "unknown parameter: this server does not know it, and --strict-request-fields "
                "refuses what it does not know (check its name)",
            ),
            loc=(name,),
            input=data[name],
        )
        for name in unknown[:MAX_UNKNOWN_REPORTED]
    ]
    raise ValidationError.from_exception_data(model.__name__, errors)


class StrictModel(BaseModel):
    """A request object: the fields it does not declare are dropped or a 400 (see above).
    Pydantic itself ignores them (``extra="ignore"``), so the OpenAPI schema does not call them
    invalid: by default they are not."""

    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _unknown(cls, data: Any) -> Any:
        return _unknown_fields(cls, data)


class IgnoredFieldLog:
    """Whether to log an ignored name now: each name at most every ``interval_s``; past
    ``max_names`` names in an interval, one new name is logged an interval and the rest are not."""

    def __init__(self, max_names: int = MAX_LOGGED_NAMES, interval_s: float = LOG_INTERVAL_S):
        self.max_names, self.interval_s = max_names, interval_s
        self.reset()

    def reset(self) -> None:
        self._logged: dict[str, float] = {}  # name -> when
        self._overflow_logged = float("-inf")

    def due(self, name: str) -> bool:
        now = time.monotonic()
        if now - self._logged.get(name, float("-inf")) < self.interval_s:
            return False
        self._logged.pop(name, None)
        if len(self._logged) >= self.max_names:  # forget the names past their interval
            self._logged = {n: t for n, t in self._logged.items() if now - t < self.interval_s}
        if len(self._logged) < self.max_names:
            self._logged[name] = now
            return True
        if now - self._overflow_logged >= self.interval_s:
            self._overflow_logged = now
            return True
        return False


IGNORED_LOG = IgnoredFieldLog()


def log_ignored(names: list[str], path: str) -> None:
    for name in dict.fromkeys(names):
        if IGNORED_LOG.due(name):
            logger.warning(
                "request field %r of %s is not one this server knows: ignored (once a name every "
                "%.0f minutes; --strict-request-fields refuses such fields)",
                name, path, LOG_INTERVAL_S / 60,
            )  # fmt: skip


class UnknownFieldsMiddleware:
    """Sets each HTTP request's policy for unknown fields, and logs the ones it ignored."""

    def __init__(self, app, strict: bool) -> None:
        self.app, self.strict = app, strict

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        ignored: list[str] = []
        strict, collected = STRICT.set(self.strict), IGNORED.set(ignored)

        async def send_logging(message) -> None:
            if message["type"] == "http.response.start" and ignored:
                log_ignored(ignored, scope.get("path", ""))
                ignored.clear()
            await send(message)

        try:
            await self.app(scope, receive, send_logging)
        finally:
            STRICT.reset(strict)
            IGNORED.reset(collected)
