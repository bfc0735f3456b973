"""Timing two or more paths of one operation against each other: calls alternate which path
goes first, the first round is a warm-up, and each path's fastest call counts; and the benches'
shared arguments (threads, dtype)."""

import sys
import time
from collections.abc import Callable, Sequence

import torch

from llmrpc.kernels import cpu_ops


def setup() -> tuple[int, torch.dtype]:
    """The bench's threads and dtype from its arguments (2 and bfloat16 by default), set, with
    the C++ kernels loaded (or the bench ends saying why)."""
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    dtype = getattr(torch, sys.argv[2]) if len(sys.argv) > 2 else torch.bfloat16
    if not cpu_ops.load():
        sys.exit("the C++ kernels did not build here")
    torch.set_num_threads(threads)
    return threads, dtype


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
