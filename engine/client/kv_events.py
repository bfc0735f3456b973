"""The prefix cache's events on the frontend's side: numbered in batches, kept for a while, and
handed to each subscriber (``--kv-events-config``; the gRPC servicer of
``vllm.grpc.engine.VllmEngine/SubscribeKvEvents`` is its reader, ``server/vllm_engine.py``).

Each ``KVEvents`` message of an engine core (the events of one step or command) becomes one
``KVEventBatch``, numbered one after the other in the order they arrive, across the engines of
a data-parallel client (each batch says its engine's rank). The first number is the time the
log was made, in microseconds since the epoch: a server started later at the same address
numbers above an earlier one's, so a subscriber that resumes across a restart is refused (it
holds the earlier server's blocks) rather than taking the new batches for ones it has seen and
skipping them. The last ``buffer_steps`` batches are
kept, so a subscriber that lost its stream resumes where it left off (``start``); one that asks
for batches no longer kept, or for numbers this log has not reached (another server's numbering),
gets ``ReplayUnavailable``. A subscriber that falls ``max_queue_size`` batches behind is dropped
with ``SubscriberBehind``: it has lost events and must start again from the current state. The
log lives on the event loop: ``append`` and every subscription's reads happen there.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from llmrpc.engine.config import EngineConfig
from llmrpc.engine.kv_events import KVEvent


@dataclass
class KVEventBatch:
    sequence_number: int
    timestamp: float  # time.time() when the engine core took the events
    events: list[KVEvent]
    dp_rank: int | None  # the engine's rank in a data-parallel client; None: the only engine


class ReplayUnavailable(Exception):
    """The batches a subscriber asked to resume from are not (or not yet) in the log."""


class SubscriberBehind(Exception):
    """A subscriber fell too far behind; the batches it missed are gone."""


class KVEventsEnded(Exception):
    """No more events will come: the engine stopped."""


class Subscription:
    """One subscriber's batches not yet read (``next_batches``)."""

    def __init__(self, replay: list[KVEventBatch], limit: int) -> None:
        self._pending: collections.deque[KVEventBatch] = collections.deque(replay)
        self._limit = limit + len(replay)  # the replay does not count against the live bound
        self._ready = asyncio.Event()
        self._error: BaseException | None = None
        if replay:
            self._ready.set()

    def _put(self, batch: KVEventBatch) -> None:
        if self._error is not None:
            return
        if len(self._pending) >= self._limit:
            self._pending.clear()  # useless now: the subscriber must start again
            self._end(SubscriberBehind(f"fell {self._limit} event batches behind (max_queue_size)"))
            return
        self._pending.append(batch)
        self._ready.set()

    def _end(self, error: BaseException) -> None:
        self._error = error
        self._ready.set()

    async def next_batches(self) -> list[KVEventBatch]:
        """The batches that came since the last call, waiting for one; once those are read,
        raises why the subscription ended (``SubscriberBehind``, ``KVEventsEnded``)."""
        await self._ready.wait()
        if not self._pending and self._error is not None:
            raise self._error
        batches = list(self._pending)
        self._pending.clear()
        if self._error is None:
            self._ready.clear()
        return batches


class KVEventLog:
    def __init__(self, buffer_steps: int, max_queue_size: int) -> None:
        self._history: collections.deque[KVEventBatch] = collections.deque(maxlen=buffer_steps)
        self._max_queue_size = max_queue_size
        self._subscribers: set[Subscription] = set()
        self.next_sequence_number = time.time_ns() // 1000
        self.ended: BaseException | None = None

    @classmethod
    def for_config(cls, config: EngineConfig) -> KVEventLog | None:
        """The log --kv-events-config asks for; None where it does not enable events."""
        cache = config.cache
        if not cache.kv_events:
            return None
        return cls(
            cache.kv_events_setting("buffer_steps"), cache.kv_events_setting("max_queue_size")
        )

    def append(self, events: list[KVEvent], timestamp: float, dp_rank: int | None = None) -> None:
        """One engine message's events, as the next batch."""
        batch = KVEventBatch(self.next_sequence_number, timestamp, events, dp_rank)
        self.next_sequence_number += 1
        self._history.append(batch)
        for subscription in list(self._subscribers):
            subscription._put(batch)

    def end(self, error: BaseException) -> None:
        """No more events (the engine died): each subscription ends once it has read its batches."""
        self.ended = KVEventsEnded(str(error))
        for subscription in self._subscribers:
            subscription._end(self.ended)

    @contextmanager
    def subscribe(self, start: int = 0) -> Iterator[Subscription]:
        """A subscription for the block: batches from number ``start`` on (0: those that come
        from now on). Raises ``ReplayUnavailable`` when ``start`` is neither kept nor next."""
        if self.ended is not None:
            raise self.ended
        replay: list[KVEventBatch] = []
        if start:
            first_kept = self._history[0].sequence_number if self._history else None
            if start > self.next_sequence_number:
                raise ReplayUnavailable(
                    f"batch {start} is ahead of this server's events (the next is "
                    f"{self.next_sequence_number}): numbering starts again with each server"
                )
            if start < self.next_sequence_number and (first_kept is None or start < first_kept):
                raise ReplayUnavailable(
                    f"batch {start} is no longer kept (buffer_steps: the oldest kept is "
                    f"{first_kept if first_kept is not None else self.next_sequence_number})"
                )
            replay = [batch for batch in self._history if batch.sequence_number >= start]
        subscription = Subscription(replay, self._max_queue_size)
        self._subscribers.add(subscription)
        try:
            yield subscription
        finally:
            self._subscribers.discard(subscription)

    @property
    def num_subscribers(self) -> int:
        return len(self._subscribers)
