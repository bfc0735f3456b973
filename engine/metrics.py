"""Load figures the engine keeps about itself."""

from __future__ import annotations

import time
from collections import deque


class RateMeter:
    """Events per second over a sliding window of recent time. Not thread-safe: the engine
    thread alone uses it (others read ``EngineStats`` snapshots)."""

    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self._events: deque[tuple[float, int]] = deque()
        self._total = 0  # the sum of the counts in _events

    def add(self, count: int, now: float | None = None) -> None:
        if count:
            self._events.append((time.monotonic() if now is None else now, count))
            self._total += count

    def rate(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        while self._events and self._events[0][0] < now - self.window_s:
            self._total -= self._events.popleft()[1]
        return self._total / self.window_s
