"""Timing two or more paths of one operation against each other: calls alternate which path
goes first, the first round is a warm-up, and each path's fastest call counts."""

import time
from collections.abc import Callable, Sequence


def fastest(
    paths: Sequence[str], run: Callable[[str], object], rounds: int = 7
) -> dict[str, float]:
    """Seconds of each path's fastest call of ``run(path)`` over ``rounds`` timed rounds."""
    best = dict.fromkeys(paths, float("inf"))
    for round_ in range(rounds + 1):
        for path in paths if round_ % 2 else paths[::-1]:
            started = time.perf_counter()
            run(path)
            if round_:  # the first is a warm-up
                best[path] = min(best[path], time.perf_counter() - started)
    return best
