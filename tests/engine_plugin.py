"""The tests' engine plug-in (``LLMRPC_ENGINE_PLUGINS=engine_plugin``, set by tests/conftest.py
with this folder on ``PYTHONPATH``): a ``call_function`` utility that runs a module-level
function of the tests inside the engine core, in either engine mode, and ``call_in_core`` to
call it. Only the function's name and its arguments cross (plain data)."""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Callable

from llmrpc.engine.core.plugins import register_utility


def _call_function(core, reference: str, *args):
    module_name, _, qualname = reference.partition(":")
    target = importlib.import_module(module_name)
    for part in qualname.split("."):
        target = getattr(target, part)
    return target(core, *args)


register_utility("call_function", _call_function)


def call_in_core(engine, function: Callable, *args) -> asyncio.Future:
    """``function(core, *args)`` where ``engine``'s core lives, between two steps: a future of
    its result (sent at once: commands sent later run after it)."""
    reference = f"{function.__module__}:{function.__qualname__}"
    return engine.call_utility("call_function", reference, *args)
