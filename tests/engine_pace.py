"""Slowing a live engine down, so that requests stay in flight long enough to act on them.

Either mode: the engine core on a thread of this process (changed at once, from any thread), or
in a process of its own (changed by its next command; from another thread than the engine's
event loop, the call waits until it is done).
"""

from __future__ import annotations

import asyncio

import engine_hooks
from engine_plugin import call_in_core


def slow_down(engine, seconds_per_step: float) -> None:
    """Make every engine step take at least ``seconds_per_step``."""
    in_core(engine, engine_hooks.pace, seconds_per_step)


def restore_speed(engine) -> None:
    in_core(engine, engine_hooks.pace, None)


def num_live_requests(engine) -> int:
    stats = engine.stats
    return stats.num_running + stats.num_waiting


def in_core(engine, function, *args) -> None:
    """``function(core, *args)`` (an ``engine_hooks`` function) where the engine core runs."""
    core = getattr(engine, "core", None)
    if core is not None:
        function(core, *args)
        return
    try:
        on_its_loop = asyncio.get_running_loop() is engine._loop
    except RuntimeError:
        on_its_loop = False
    if on_its_loop:  # sent now, ahead of any request sent after it; the result is not awaited
        call_in_core(engine, function, *args).add_done_callback(_result)
        return

    async def call():
        return await call_in_core(engine, function, *args)

    asyncio.run_coroutine_threadsafe(call(), engine._loop).result(timeout=60)


def _result(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.result()  # an error shows in the log of the loop's exception handler
