"""Slowing a live engine down, so that requests stay in flight long enough to act on them."""

from __future__ import annotations

import time


def slow_down(engine, seconds_per_step: float) -> None:
    """Make every engine step take at least ``seconds_per_step``."""
    real_step = engine.core.step

    def slow_step():
        time.sleep(seconds_per_step)
        return real_step()

    engine.core.step = slow_step


def restore_speed(engine) -> None:
    del engine.core.step  # the instance attribute set by slow_down hid the method


def num_live_requests(engine) -> int:
    stats = engine.stats
    return stats.num_running + stats.num_waiting
