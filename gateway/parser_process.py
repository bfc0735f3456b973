"""Very large request bodies are parsed in a process of the gateway's own.

CPython's JSON parser and pydantic hold the GIL while they run: parsing megabytes of JSON on a
thread still stalls the event loop (health checks, every stream in flight, and inside
``llmrpc serve`` the gRPC server too) for as long as the parse takes. Above
``OFF_PROCESS_BYTES`` the body goes to a parser process, which checks it as ``json_body.parse``
does, also refuses any list longer than the served model could use (``max_items``), and
validates it as the route's body model there: what comes back is a validated request (its
size bounded by those checks) or an error, never the parsed document, whose unknown keys or
entries would cost the server's process as much to receive as to parse (11 MB of unknown keys
took 14 s of its GIL and 1.6 GB).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import multiprocessing
import threading

OFF_PROCESS_BYTES = 2**20

_lock = threading.Lock()
_executor: concurrent.futures.ProcessPoolExecutor | None = None


def _pool() -> concurrent.futures.ProcessPoolExecutor:
    global _executor
    with _lock:
        if _executor is None:
            # spawn: a fresh interpreter, never a fork of this threaded process
            context = multiprocessing.get_context("spawn")
            _executor = concurrent.futures.ProcessPoolExecutor(1, mp_context=context)
            atexit.register(_shut_down)
        return _executor


def _shut_down() -> None:
    """At exit, while the modules it needs are still there."""
    if _executor is not None:
        _executor.shutdown(wait=True, cancel_futures=True)


_adapters: dict[str, object] = {}  # in the parser process: the TypeAdapter of each body model


def _adapter(model):
    from pydantic import TypeAdapter

    key = repr(model)  # a body model may be an Annotated union, which need not be hashable
    if key not in _adapters:
        _adapters[key] = TypeAdapter(model)
    return _adapters[key]


def parse_here(body: bytes, max_items: int | None, model=None, strict: bool = True) -> tuple:
    """In the parser process: ``("ok", request, ignored)`` (the document validated as ``model``,
    when given, under the request's policy for unknown fields, ``strict``, and the names of the
    unknown fields it dropped) or ``("error", param, message)``."""
    from llmrpc.gateway.errors import OpenAIError
    from llmrpc.gateway.json_body import parse_and_validate
    from llmrpc.gateway.request_fields import IGNORED, STRICT

    ignored: list[str] = []
    policy, collected = STRICT.set(strict), IGNORED.set(ignored)
    try:
        adapter = None if model is None else _adapter(model)
        return ("ok", parse_and_validate(body, adapter, max_items), ignored)
    except OpenAIError as error:
        return ("error", error.param, error.message)
    finally:
        STRICT.reset(policy)
        IGNORED.reset(collected)


async def parse_elsewhere(
    body: bytes, max_items: int | None, model=None, strict: bool = True
) -> tuple:
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_pool(), parse_here, body, max_items, model, strict)
