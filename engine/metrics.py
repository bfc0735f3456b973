"""Load figures the engine keeps about itself."""

from __future__ import annotations

import time
from collections import deque


class RateMeter:
    """Events per second over a sliding window of recent time."""

    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self._events: deque[tuple[float, int]] = deque()

    def add(self, count: int, now: float | None = None) -> None:
        if count:
            self._events.append((time.monotonic() if now is None else now, count))

    def rate(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        while self._events and self._events[0][0] < now - self.window_s:
            self._events.popleft()
        return sum(count for _, count in self._events) / self.window_s
