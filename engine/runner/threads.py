"""How many CPU threads the engine's torch kernels use.

PyTorch's CPU kernels split each operation over a team of OpenMP threads and wait at a barrier
for all of them. A team as large as the machine shares its cores with the frontend (gRPC, REST,
detokenizing) and any client on the host: whenever one team thread is descheduled, every
operation waits for it, and a step can take ten times longer (measured on 2 cores under load:
decode at batch 1 took 31 ms with one thread, 185 ms with two). So, as vLLM's CPU backend does,
the engine leaves one core to the rest of the process: ``cores - 1`` threads (at least 1).
``OMP_NUM_THREADS`` in the environment overrides the rule.

An engine in its own process (the server's default) also takes that last core while nothing
else uses it (``ThreadBudget``): before each step it checks, at most every quarter second, how
much CPU the rest of the machine (the frontend, clients, anything else; the hypervisor's steal
included) used since the last check, and computes with every core while that was under half a
core, with one fewer otherwise. A compiled step's graph holds for torch's thread count, so
there the budget moves only our kernels' own count (``kernel_ops/csrc/kernel_threads.h``). On 2
cores with the packaged model in bfloat16, a 40-token prefill took 24 ms on two threads and 37 ms
on one; beside one busy process, 60 ms on two and 39 ms on one.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)


def engine_threads(environ=os.environ, cores: int | None = None) -> int:
    """The thread count the rule gives: ``OMP_NUM_THREADS`` if set, else usable cores - 1."""
    value = environ.get("OMP_NUM_THREADS", "").strip()
    if value:
        try:
            return max(1, int(value.split(",")[0]))
        except ValueError:
            raise ValueError(f"OMP_NUM_THREADS={value!r} is not a whole number") from None
    if cores is None:
        cores = len(os.sched_getaffinity(0))
    return max(1, cores - 1)


def cpu_threads(count: int) -> str:
    """``1 CPU thread``, ``2 CPU threads``: for the log."""
    return f"{count} CPU thread{'' if count == 1 else 's'}"


def configure_engine_threads() -> int:
    """Apply the rule on the calling thread (OpenMP teams are per calling thread: call it from
    the thread that runs the model) and return the count."""
    threads = engine_threads()
    torch.set_num_threads(threads)
    logger.info(
        "engine: %s for torch kernels (%s)",
        cpu_threads(threads),
        "OMP_NUM_THREADS"
        if os.environ.get("OMP_NUM_THREADS", "").strip()
        else "usable cores minus one, left to the frontend",
    )
    return threads


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def machine_busy_seconds(path: str = "/proc/stat") -> float | None:
    """CPU seconds the whole machine has been busy since boot (all but idle and I/O wait; the
    hypervisor's steal counts as busy), or None where ``path`` cannot be read."""
    try:
        with open(path) as stat:
            fields = stat.readline().split()
        user, nice, system, idle, iowait, irq, softirq, steal = (int(v) for v in fields[1:9])
    except (OSError, ValueError):
        return None
    return (user + nice + system + irq + softirq + steal) / _CLOCK_TICKS


def own_cpu_seconds() -> float:
    """CPU seconds this process (all its threads) has used."""
    times = os.times()
    return times.user + times.system


class ThreadBudget:
    """How many threads a step's kernels may use: ``cores`` while the rest of the machine used
    less than ``spare`` of a core since the last check, ``cores - 1`` otherwise (the module's
    docstring says why). Checks at most every ``interval`` seconds; the first check, and any
    where the machine's CPU time cannot be read, gives ``cores - 1``."""

    def __init__(
        self,
        cores: int,
        interval: float = 0.25,
        spare: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
        machine: Callable[[], float | None] = machine_busy_seconds,
        own: Callable[[], float] = own_cpu_seconds,
    ) -> None:
        self.cores, self.interval, self.spare = cores, interval, spare
        self._clock, self._machine, self._own = clock, machine, own
        self.threads = max(1, cores - 1)
        self.others = None  # cores the rest of the machine used over the last interval
        self._last: tuple[float, float, float] | None = None

    def threads_now(self) -> int:
        now = self._clock()
        if self._last is not None and now - self._last[0] < self.interval:
            return self.threads
        busy, own = self._machine(), self._own()
        if busy is None:
            self._last, self.threads = None, max(1, self.cores - 1)
            return self.threads
        if self._last is not None:
            then, busy_then, own_then = self._last
            self.others = max(0.0, (busy - busy_then) - (own - own_then)) / (now - then)
            self.threads = self.cores if self.others < self.spare else max(1, self.cores - 1)
        self._last = (now, busy, own)
        return self.threads


def idle_core_budget(environ=os.environ, cores: int | None = None) -> ThreadBudget | None:
    """A ``ThreadBudget`` for an engine in its own process, or None where the count is fixed:
    ``OMP_NUM_THREADS`` set, a single usable core, or no ``/proc/stat`` to read."""
    if environ.get("OMP_NUM_THREADS", "").strip():
        return None
    if cores is None:
        cores = len(os.sched_getaffinity(0))
    if cores < 2 or machine_busy_seconds() is None:
        return None
    return ThreadBudget(cores)
