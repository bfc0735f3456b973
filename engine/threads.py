"""How many CPU threads the engine's torch kernels use.

PyTorch's CPU kernels split each operation over a team of OpenMP threads and wait at a barrier
for all of them. A team as large as the machine shares its cores with the frontend (gRPC, REST,
detokenizing) and any client on the host: whenever one team thread is descheduled, every
operation waits for it, and a step can take ten times longer (measured on 2 cores under load:
decode at batch 1 took 31 ms with one thread, 185 ms with two). So, as vLLM's CPU backend does,
the engine leaves one core to the rest of the process: ``cores - 1`` threads (at least 1).
``OMP_NUM_THREADS`` in the environment overrides the rule.
"""

from __future__ import annotations

import logging
import os

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


def configure_engine_threads() -> int:
    """Apply the rule on the calling thread (OpenMP teams are per calling thread: call it from
    the thread that runs the model) and return the count."""
    threads = engine_threads()
    torch.set_num_threads(threads)
    logger.info(
        "engine: %d CPU thread%s for torch kernels (%s)",
        threads,
        "" if threads == 1 else "s",
        "OMP_NUM_THREADS"
        if os.environ.get("OMP_NUM_THREADS", "").strip()
        else "usable cores minus one, left to the frontend",
    )
    return threads
