"""KV block pool and prefix cache: exact block ids, reference counts and eviction order."""

from __future__ import annotations

import pytest

from llmrpc.engine.lora.types import LoRARef
from llmrpc.engine.request import Request, SamplingParams
from llmrpc.engine.sched.kv_cache import BlockPool, FreeBlockQueue, KVBlock, KVCacheManager

BLOCK = 4


def make_request(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id, tokens, SamplingParams())


def schedule_all(manager: KVCacheManager, request: Request) -> list[int]:
    """Prefix hits, then room for the rest of the prompt (what the scheduler does on admission),
    then the forward pass computes it; ``request.num_cached_tokens`` are the hits."""
    hits = manager.get_computed_blocks(request)
    num_hit_tokens = len(hits) * BLOCK
    assert manager.allocate_slots(request, request.num_tokens - num_hit_tokens, hits) is not None
    request.num_cached_tokens = num_hit_tokens
    request.num_computed_tokens = request.num_tokens
    return manager.block_ids(request.request_id)


def test_free_queue_pops_in_order_and_removes_from_the_middle():
    blocks = [KVBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])
    assert queue.block_ids() == [0, 1, 3, 4]
    assert queue.popleft() is blocks[0]
    queue.append(blocks[0])
    assert queue.block_ids() == [1, 3, 4, 0]
    assert queue.num_free_blocks == 4


def test_new_request_gets_fresh_blocks_in_order():
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK)
    request = make_request("a", list(range(10)))
    assert schedule_all(manager, request) == [0, 1, 2]
    assert manager.num_free_blocks == 5
    # One decode token fits the third block; the thirteenth token needs a fourth.
    request.num_computed_tokens = 10
    request.append_output_token(99)
    assert manager.allocate_slots(request, 1) == []
    request.num_computed_tokens = 11
    request.append_output_token(98)
    request.append_output_token(97)
    new = manager.allocate_slots(request, 2)
    assert [b.block_id for b in new] == [3]
    assert manager.block_ids("a") == [0, 1, 2, 3]


def test_the_high_water_mark_counts_the_blocks_ever_handed_out():
    """Never-used blocks go first and in id order, so blocks 0 to high_water - 1 are the ones
    ever written: what the host cache's pages are faulted in ahead of."""
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK)
    assert manager.pool.high_water == 0
    first = make_request("a", list(range(10)))
    schedule_all(manager, first)
    assert manager.pool.high_water == 3
    manager.free(first)  # its blocks stay cached at the queue's tail
    schedule_all(manager, make_request("b", list(range(100, 110))))
    assert manager.block_ids("b") == [3, 4, 5]
    assert manager.pool.high_water == 6
    schedule_all(manager, make_request("c", list(range(200, 210))))  # evicts a block of a
    assert manager.block_ids("c") == [6, 7, 2]  # a's tail block, the first evicted
    assert manager.pool.high_water == 8


@pytest.mark.parametrize("hash_algo", ["builtin", "sha256", "sha256_cbor_64bit"])
def test_shared_prefix_reuses_full_blocks_and_counts_references(hash_algo):
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK, hash_algo=hash_algo)
    a = make_request("a", list(range(10)))  # blocks 0, 1 full; 2 partial
    schedule_all(manager, a)
    b = make_request("b", list(range(8)) + [50, 51, 52])
    assert schedule_all(manager, b) == [0, 1, 3]
    assert b.num_cached_tokens == 8
    assert [manager.pool.blocks[i].ref_cnt for i in range(4)] == [2, 2, 1, 1]
    assert manager.num_prefix_hits == 8


def test_fully_cached_prompt_still_computes_its_last_token():
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK)
    schedule_all(manager, make_request("a", list(range(8))))
    again = make_request("b", list(range(8)))
    assert schedule_all(manager, again) == [0, 2]
    assert again.num_cached_tokens == 4


def test_freed_blocks_stay_cached_and_tails_are_evicted_first():
    manager = KVCacheManager(num_blocks=6, block_size=BLOCK)
    a = make_request("a", list(range(10)))
    schedule_all(manager, a)  # [0, 1, 2]
    b = make_request("b", list(range(8)) + [50])
    schedule_all(manager, b)  # [0, 1, 3]
    manager.free(a)
    manager.free(b)
    assert manager.pool.free_queue.block_ids() == [4, 5, 2, 3, 1, 0]
    # A hit takes cached blocks back out of the free queue.
    c = make_request("c", list(range(8)) + [60, 61])
    assert schedule_all(manager, c) == [0, 1, 4]
    assert manager.pool.free_queue.block_ids() == [5, 2, 3]
    # Evicting block 1 (the second full block) would need all free blocks; the cached prefix stays.
    manager.free(c)
    d = make_request("d", list(range(100, 120)))  # 5 blocks: 5, 2, 3, 4, 1 in eviction order
    assert schedule_all(manager, d) == [5, 2, 3, 4, 1]
    e = make_request("e", list(range(8)) + [70])
    hits = manager.get_computed_blocks(e)
    assert [b.block_id for b in hits] == [0]  # block 1's prefix was evicted, block 0's was not


def test_allocation_failure_changes_nothing():
    manager = KVCacheManager(num_blocks=2, block_size=BLOCK)
    request = make_request("a", list(range(12)))
    assert manager.allocate_slots(request, 12) is None
    assert manager.num_free_blocks == 2
    assert manager.block_ids("a") == []


def test_cache_hit_checks_the_tokens_not_only_the_hash():
    pool = BlockPool(num_blocks=2)
    block = pool.get_new_blocks(1)[0]
    pool.cache_block(block, block_hash=1234, token_ids=(1, 2, 3, 4))
    assert pool.get_cached_block(1234, (1, 2, 3, 4)) is block
    assert pool.get_cached_block(1234, (9, 9, 9, 9)) is None


def test_reset_prefix_cache_only_when_idle():
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK)
    request = make_request("a", list(range(8)))
    schedule_all(manager, request)
    assert not manager.reset_prefix_cache()
    manager.free(request)
    assert manager.reset_prefix_cache()
    assert manager.get_computed_blocks(make_request("b", list(range(8)))) == []


def test_hash_algorithms_chain_and_differ_in_kind():
    hashes = {}
    for algo in ("builtin", "sha256", "sha256_cbor_64bit"):
        manager = KVCacheManager(num_blocks=4, block_size=BLOCK, hash_algo=algo)
        request = make_request("a", list(range(8)))
        manager.update_block_hashes(request)
        other = make_request("b", [99] + list(range(1, 8)))  # differs in the first block only
        manager.update_block_hashes(other)
        assert request.block_hashes[0] != other.block_hashes[0]
        assert request.block_hashes[1] != other.block_hashes[1]  # the chain carries the change
        hashes[algo] = request.block_hashes
    assert all(isinstance(h, bytes) and len(h) == 32 for h in hashes["sha256"])
    assert all(isinstance(h, int) and 0 <= h < 2**64 for h in hashes["sha256_cbor_64bit"])


def test_unknown_hash_algorithm_names_the_flag():
    with pytest.raises(ValueError, match="--prefix-caching-hash-algo"):
        KVCacheManager(num_blocks=4, block_size=BLOCK, hash_algo="md5")


@pytest.mark.parametrize("hash_algo", ["builtin", "sha256", "sha256_cbor_64bit"])
def test_prefix_blocks_are_shared_only_under_the_same_lora_adapter(hash_algo):
    manager = KVCacheManager(num_blocks=12, block_size=BLOCK, hash_algo=hash_algo)
    tokens = list(range(10))  # two full blocks and a partial one

    def under(request_id: str, lora_id: int | None) -> Request:
        request = make_request(request_id, tokens)
        request.lora = None if lora_id is None else LoRARef(f"adapter{lora_id}", lora_id, "/a")
        return request

    assert schedule_all(manager, under("base", None)) == [0, 1, 2]
    assert schedule_all(manager, under("lora1", 1)) == [3, 4, 5]  # same tokens, no hit
    assert schedule_all(manager, under("lora2", 2)) == [6, 7, 8]
    again = under("lora1-again", 1)
    assert schedule_all(manager, again) == [3, 4, 9]  # lora1's own blocks
    assert again.num_cached_tokens == 8
    assert schedule_all(manager, under("base-again", None)) == [0, 1, 10]


def test_freeing_a_request_before_its_chunk_is_computed_uncaches_that_chunk():
    """Blocks are registered when allocated, for the tokens the step will compute; a request that
    leaves the step (preempted) and is freed takes back the registrations of what it never
    computed, and keeps those of what it did."""
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK)
    request = make_request("a", list(range(20)))
    assert manager.allocate_slots(request, 8) is not None  # tokens 0..7: blocks 0, 1
    request.num_computed_tokens = 8  # the forward pass ran
    assert manager.allocate_slots(request, 8) is not None  # tokens 8..15: blocks 2, 3
    manager.free(request)  # before that chunk was computed
    assert sorted(block.block_id for block in manager.pool.cached.values()) == [0, 1]
    again = make_request("b", list(range(20)))
    assert [block.block_id for block in manager.get_computed_blocks(again)] == [0, 1]
    assert manager.pool.free_queue.block_ids() == [4, 5, 6, 7, 3, 2, 1, 0]


def test_blocks_before_every_window_are_released_and_stay_cached():
    """Window 6, blocks of 4: a token at position p reads keys from p - 5 on. A 14-token prompt
    then decodes: each step releases the blocks wholly before its first token's window (to the
    free queue, still cached), the table keeps their places at block 0, and freeing the request
    releases the rest once. A second request with the same prompt hits the released blocks."""
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK, window=6)
    request = make_request("a", list(range(14)))
    assert schedule_all(manager, request) == [0, 1, 2, 3]  # computed from position 0: all kept
    request.append_output_token(99)  # position 14 sees 9..14: block 0 (0-3) and 1 (4-7) unread
    assert manager.allocate_slots(request, 1) == []
    assert manager.block_ids("a") == [0, 0, 2, 3]
    assert manager.num_free_blocks == 6
    request.num_computed_tokens = 15
    request.append_output_token(98)  # position 15 sees 10..15: still blocks 2 and 3
    assert manager.allocate_slots(request, 1) is not None
    assert manager.block_ids("a") == [0, 0, 2, 3] and manager.num_free_blocks == 6
    request.num_computed_tokens = 16
    manager.free(request)
    assert manager.num_free_blocks == 8
    assert all(block.ref_cnt == 0 for block in manager.pool.blocks)
    again = make_request("b", list(range(14)))
    assert manager.get_computed_blocks(again) == manager.pool.blocks[:3]


def test_without_a_window_no_block_is_released():
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK)
    request = make_request("a", list(range(14)))
    schedule_all(manager, request)
    request.append_output_token(99)
    manager.allocate_slots(request, 1)
    assert manager.block_ids("a") == [0, 1, 2, 3]
