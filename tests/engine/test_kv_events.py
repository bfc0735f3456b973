"""The prefix cache's events (``--kv-events-config``): recorded by the KV cache manager as blocks
enter and leave the cache, numbered and kept by the frontend's event log, and refused settings
of the flag."""

from __future__ import annotations

import asyncio
import time

import pytest

from llmrpc.engine.client.kv_events import (
    KVEventLog,
    KVEventsEnded,
    ReplayUnavailable,
    SubscriberBehind,
)
from llmrpc.engine.config import CacheConfig
from llmrpc.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from llmrpc.engine.lora.types import LoRARef
from llmrpc.engine.request import Request, SamplingParams
from llmrpc.engine.sched.kv_cache import KVCacheManager

BLOCK = 4


def schedule_all(manager: KVCacheManager, request: Request) -> None:
    hits = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, request.num_tokens - len(hits) * BLOCK, hits) is not None
    request.num_computed_tokens = request.num_tokens


def test_stored_events_carry_chained_hashes_tokens_and_parents():
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK, record_events=True)
    a = Request("a", list(range(10)), SamplingParams())  # 2 full blocks, 1 partial
    schedule_all(manager, a)
    (stored,) = manager.take_events()
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == a.block_hashes[:2]
    assert stored.parent_block_hash is None  # a prompt's first block
    assert stored.token_ids == list(range(8)) and stored.block_size == BLOCK
    assert manager.take_events() == []  # taken once
    # The same prefix again: a hit, nothing new stored until its own third block fills.
    b = Request("b", [*range(8), 50, 51, 52, 53, 54], SamplingParams())
    schedule_all(manager, b)
    (more,) = manager.take_events()
    assert more.block_hashes == [b.block_hashes[2]]
    assert more.parent_block_hash == a.block_hashes[1]  # the chain goes on from the hit
    assert more.token_ids == [50, 51, 52, 53]


def test_evictions_are_removed_events_and_a_reset_is_one_cleared_event():
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK, record_events=True)
    a = Request("a", list(range(8)), SamplingParams())
    schedule_all(manager, a)
    manager.free(a)  # its 2 blocks stay cached, free
    b = Request("b", list(range(100, 116)), SamplingParams())  # needs all 4 blocks
    schedule_all(manager, b)
    events = manager.take_events()
    assert isinstance(events[0], BlockStored)
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert len(removed) == 1  # removals in a row: one event
    assert sorted(map(str, removed[0].block_hashes)) == sorted(map(str, a.block_hashes[:2]))
    manager.free(b)
    assert manager.reset_prefix_cache()
    assert manager.take_events() == [AllBlocksCleared()]


def test_lora_blocks_say_their_adapter_and_nothing_is_recorded_unless_asked():
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK, record_events=True)
    request = Request("a", list(range(5)), SamplingParams())
    request.lora = LoRARef("sql", 3, "/adapters/sql")
    schedule_all(manager, request)
    (stored,) = manager.take_events()
    assert (stored.lora_id, stored.lora_name) == (3, "sql")
    quiet = KVCacheManager(num_blocks=8, block_size=BLOCK)
    schedule_all(quiet, Request("a", list(range(9)), SamplingParams()))
    assert quiet.take_events() == [] and quiet.pool.events is None


async def test_the_log_numbers_batches_replays_and_drops_a_subscriber_behind():
    earlier = KVEventLog(buffer_steps=3, max_queue_size=2)
    time.sleep(0.001)
    log = KVEventLog(buffer_steps=3, max_queue_size=2)
    first = log.next_sequence_number
    assert first > earlier.next_sequence_number > 0  # a later log numbers above an earlier one
    for n in range(4):  # batches first..first+3; the first falls out of the buffer of 3
        log.append([AllBlocksCleared()], float(n), dp_rank=None)
    with log.subscribe(first + 1) as replayed:
        numbers = [b.sequence_number for b in await replayed.next_batches()]
        assert numbers == [first + 1, first + 2, first + 3]
    # no longer kept; ahead of this log; an earlier server's number
    for start in (first, first + 5, earlier.next_sequence_number):
        with pytest.raises(ReplayUnavailable), log.subscribe(start):
            pass
    with log.subscribe(first + 4) as live:  # the next one: nothing to replay
        log.append([], 5.0, dp_rank=1)
        (batch,) = await live.next_batches()
        assert (batch.sequence_number, batch.dp_rank) == (first + 4, 1)
        for n in range(3):  # a third unread batch is one more than max_queue_size
            log.append([], 6.0 + n)
        with pytest.raises(SubscriberBehind):
            await live.next_batches()
    assert log.num_subscribers == 0


async def test_a_subscription_ends_when_the_engine_dies():
    log = KVEventLog(buffer_steps=10, max_queue_size=10)
    with log.subscribe() as subscription:
        waiting = asyncio.ensure_future(subscription.next_batches())
        await asyncio.sleep(0)
        log.end(RuntimeError("engine process exited"))
        with pytest.raises(KVEventsEnded):
            await waiting
    with pytest.raises(KVEventsEnded), log.subscribe():
        pass


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"enable_kv_cache_events": True, "publisher": "zmq"}, "'publisher': this build"),
        ({"endpoint": "tcp://*:5557"}, "'endpoint'"),
        ({"enable_kv_cache_events": "yes"}, "must be true or false"),
        ({"buffer_steps": 0}, "buffer_steps must be a positive integer"),
        ({"spelling": 1}, "unknown key 'spelling'"),
    ],
)
def test_the_flag_refuses_what_it_cannot_do_by_name(config, message):
    with pytest.raises(ValueError, match="--kv-events-config") as error:
        CacheConfig(kv_events_config=config)
    assert message in str(error.value)


def test_events_need_the_prefix_cache():
    with pytest.raises(ValueError, match="--no-enable-prefix-caching"):
        CacheConfig(enable_prefix_caching=False, kv_events_config={"enable_kv_cache_events": True})
    config = CacheConfig(kv_events_config={"enable_kv_cache_events": True, "buffer_steps": 7})
    assert config.kv_events and config.kv_events_setting("buffer_steps") == 7
    assert config.kv_events_setting("max_queue_size") == 100_000
    assert not CacheConfig().kv_events
