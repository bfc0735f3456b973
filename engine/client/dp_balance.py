"""Which of a data-parallel server's engines takes a new request (``--data-parallel-size``).

Each engine's load is the requests the frontend has given it and not yet seen finish (running
plus waiting, counted per sample), kept here as they start and end: fresher than the figures
the engines publish after each step, and exact for a burst of requests arriving together.

A request goes to the least-loaded engine; among equals, the next in turn after the last one
chosen, so that requests arriving one at a time alternate. Prefix preference, where cheap:
the hashes of a prompt's first few full KV blocks (chained, as the engine's prefix cache
hashes them) remember the engine that last took that prefix; a request whose prefix is
remembered goes back to that engine, whose prefix cache probably still holds it, while that
engine's load is within ``prefix_slack`` of the least load. The longest remembered prefix
wins. The memory is bounded (least recently used prefixes are forgotten). Engines the caller
names unavailable (a stalled one) take nothing while another can.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence

# Prompt blocks whose prefixes are remembered: chat prompts share their first blocks (template
# and system prompt), conversations their history; beyond 8 blocks the hashing costs more than
# a better choice could return.
MAX_PREFIX_BLOCKS = 8
# Prefixes remembered (each an int key and an engine index).
MAX_REMEMBERED_PREFIXES = 16384
# How many requests more than the least-loaded engine an engine may hold and still take a
# request whose prefix it served: a prefix hit saves that request's prefill of those blocks,
# which on a busy engine is worth less than a place in a less busy batch.
PREFIX_SLACK = 2


def prefix_hashes(prompt_token_ids: Sequence[int], block_size: int) -> list[int]:
    """Chained hashes of the prompt's first full blocks (at most ``MAX_PREFIX_BLOCKS``), the
    shortest prefix first."""
    hashes = []
    previous = 0
    num_blocks = min(len(prompt_token_ids) // block_size, MAX_PREFIX_BLOCKS)
    for index in range(num_blocks):
        block = tuple(prompt_token_ids[index * block_size : (index + 1) * block_size])
        previous = hash((previous, block))
        hashes.append(previous)
    return hashes


class LoadBalancer:
    """Chooses an engine for each request and counts what each engine holds."""

    def __init__(
        self,
        num_engines: int,
        block_size: int,
        prefix_aware: bool = True,
        prefix_slack: int = PREFIX_SLACK,
        max_prefixes: int = MAX_REMEMBERED_PREFIXES,
    ) -> None:
        if num_engines < 1:
            raise ValueError(f"--data-parallel-size must be 1 or more, got {num_engines}")
        self.loads = [0] * num_engines  # samples given to each engine and not yet finished
        self.num_routed = [0] * num_engines  # requests given to each engine since start
        self.block_size = block_size
        self.prefix_aware = prefix_aware
        self.prefix_slack = prefix_slack
        self._max_prefixes = max_prefixes
        self._prefixes: OrderedDict[int, int] = OrderedDict()  # prefix hash -> engine
        self._last = num_engines - 1  # so that the first tie goes to engine 0

    def choose(self, prompt_token_ids: Sequence[int], unavailable: Collection[int] = ()) -> int:
        """The engine for a request with this prompt, not one of ``unavailable`` unless all
        are; remembers its prefixes there."""
        hashes = prefix_hashes(prompt_token_ids, self.block_size) if self.prefix_aware else []
        available = [i for i in range(len(self.loads)) if i not in unavailable]
        available = available or list(range(len(self.loads)))
        engine = self._preferred(hashes, available)
        if engine is None:
            engine = self._least_loaded(available)
        self._last = engine
        for key in hashes:
            self._prefixes[key] = engine
            self._prefixes.move_to_end(key)
        while len(self._prefixes) > self._max_prefixes:
            self._prefixes.popitem(last=False)
        return engine

    def started(self, engine: int, num_samples: int = 1) -> None:
        self.loads[engine] += num_samples
        self.num_routed[engine] += 1

    def finished(self, engine: int, num_samples: int = 1) -> None:
        self.loads[engine] -= num_samples

    def _preferred(self, hashes: list[int], available: list[int]) -> int | None:
        """The engine that took this prompt's longest remembered prefix, if available and not
        too busy."""
        least = min(self.loads[i] for i in available)
        for key in reversed(hashes):
            engine = self._prefixes.get(key)
            if engine is not None:
                fits = engine in available and self.loads[engine] <= least + self.prefix_slack
                return engine if fits else None
        return None

    def _least_loaded(self, available: list[int]) -> int:
        least = min(self.loads[i] for i in available)
        count = len(self.loads)
        for step in range(1, count + 1):
            engine = (self._last + step) % count
            if engine in available and self.loads[engine] == least:
                return engine
        raise AssertionError("unreachable: some engine has the least load")
