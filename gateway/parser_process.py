"""Very large request bodies are parsed in a process of the gateway's own.

CPython's JSON parser and pydantic hold the GIL while they run: parsing megabytes of JSON on a
thread still stalls the event loop (health checks, every stream in flight, and inside
``llmrpc serve`` the gRPC server too) for as long as the parse takes. Above
``OFF_PROCESS_BYTES`` the body goes to a parser process, which checks it as ``json_body.parse``
does and also refuses any list longer than the served model could use (``max_items``), so what
comes back is small or a plain string, both cheap to receive and validate.
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


def _long_list(document, max_items: int) -> tuple[str | None, str] | None:
    """(parameter, what is wrong) for the first list longer than ``max_items``; None if none."""
    stack = [(None, document)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, list):
            if len(value) > max_items:
                return path, (
                    f"{path or 'the body'} has {len(value)} items; at most {max_items} can be "
                    "served (the model's context length or vocabulary size)"
                )
            stack.extend((f"{path or ''}[{i}]", item) for i, item in enumerate(value))
        elif isinstance(value, dict):
            stack.extend((f"{path}.{key}" if path else key, item) for key, item in value.items())
    return None


def parse_here(body: bytes, max_items: int | None) -> tuple:
    """In the parser process: ``("ok", document)`` or ``("error", param, message)``."""
    from llmrpc.gateway.errors import OpenAIError
    from llmrpc.gateway.json_body import parse

    try:
        document = parse(body)
    except OpenAIError as error:
        return ("error", error.param, error.message)
    found = None if max_items is None else _long_list(document, max_items)
    return ("ok", document) if found is None else ("error", *found)


async def parse_elsewhere(body: bytes, max_items: int | None) -> tuple:
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_pool(), parse_here, body, max_items)
