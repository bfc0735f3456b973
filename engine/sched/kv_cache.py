"""Paged KV cache bookkeeping: a block pool with an O(1) free queue and a prefix cache.

Pure Python and deterministic. A block is identified by its ``block_id``, the row of the KV cache
tensors it stands for. A full block is keyed by a hash chained over all blocks before it, so equal
hashes mean equal prefixes; the block's own tokens are kept and checked on every hit. With
``record_events`` the cache's changes are kept as ``engine.kv_events`` events until taken.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Iterable, Sequence

import cbor2

from llmrpc.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from llmrpc.engine.request import Request


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "token_ids", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None  # set once the block is full and cached
        self.token_ids: tuple[int, ...] = ()
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref_cnt={self.ref_cnt})"


class FreeBlockQueue:
    """Doubly linked list of free blocks: pop from the head, append at the tail, remove anywhere.

    Cached blocks stay in the queue while free so that a later prefix hit can take them back;
    the head is the next block to be evicted.
    """

    def __init__(self, blocks: Sequence[KVBlock]) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("no free KV blocks")
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        assert block.prev_free is not None and block.next_free is not None
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def block_ids(self) -> list[int]:
        ids, block = [], self._head.next_free
        while block is not None and block is not self._tail:
            ids.append(block.block_id)
            block = block.next_free
        return ids


BlockHash = int | bytes


def hash_block(parent_hash: BlockHash | None, token_ids: tuple[int, ...]) -> int:
    """Chained block hash: equal hashes mean equal token prefixes (up to hash collisions)."""
    return hash((parent_hash, token_ids))


def sha256_block(parent_hash: BlockHash | None, token_ids: tuple[int, ...]) -> bytes:
    """The same chain with SHA-256 over a pickle: collision-resistant, slower."""
    return hashlib.sha256(pickle.dumps((parent_hash, token_ids), protocol=5)).digest()


def sha256_cbor_64bit_block(parent_hash: BlockHash | None, token_ids: tuple[int, ...]) -> int:
    """SHA-256 over canonical CBOR, cut to 64 bits: reproducible by other languages."""
    encoded = cbor2.dumps((parent_hash, list(token_ids)), canonical=True)
    return int.from_bytes(hashlib.sha256(encoded).digest()[:8], "big")


BLOCK_HASHERS = {
    "builtin": hash_block,
    "sha256": sha256_block,
    "sha256_cbor_64bit": sha256_cbor_64bit_block,
}


class BlockPool:
    def __init__(
        self, num_blocks: int, enable_caching: bool = True, record_events: bool = False
    ) -> None:
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        # Blocks 0 to high_water - 1 have been handed out: the queue starts in id order and
        # takes freed blocks at its tail, so never-used blocks go in that order first.
        self.high_water = 0
        self.enable_caching = enable_caching
        self.cached: dict[BlockHash, KVBlock] = {}
        # the cache's changes not yet taken (take_events); None: not recorded
        self.events: list[KVEvent] | None = [] if record_events and enable_caching else None

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVBlock]:
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        new_blocks = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            self.high_water = max(self.high_water, block.block_id + 1)
            new_blocks.append(block)
        return new_blocks

    def get_cached_block(self, block_hash: BlockHash, token_ids: tuple[int, ...]) -> KVBlock | None:
        block = self.cached.get(block_hash)
        if block is None or block.token_ids != token_ids:
            return None
        return block

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference to cached blocks found by a prefix hit."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks_in_eviction_order: Iterable[KVBlock]) -> None:
        for block in blocks_in_eviction_order:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache_block(
        self, block: KVBlock, block_hash: BlockHash, token_ids: tuple[int, ...]
    ) -> bool:
        """Enter a full block in the prefix cache; whether it was entered (False: caching is
        off, the block is cached already, or another block holds the same content)."""
        if not self.enable_caching or block.block_hash is not None:
            return False
        if block_hash in self.cached:  # same content computed twice: keep the first copy
            return False
        block.block_hash = block_hash
        block.token_ids = token_ids
        self.cached[block_hash] = block
        return True

    def uncache_block(self, block: KVBlock) -> None:
        """Forget one block's cached content (its KV was never written)."""
        self._evict(block)

    def reset_prefix_cache(self) -> bool:
        """Forget all cached blocks; refused (False) while any block is in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        events, self.events = self.events, None  # one AllBlocksCleared, not a removal each
        for block in self.blocks:
            self._evict(block)
        self.events = events
        if events is not None:
            events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVEvent]:
        """The events recorded since the last call (none when not recording)."""
        if not self.events:
            return []
        events, self.events = self.events, []
        return events

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self.events is not None:
                last = self.events[-1] if self.events else None
                if isinstance(last, BlockRemoved):  # removals in a row: one event
                    last.block_hashes.append(block.block_hash)
                else:
                    self.events.append(BlockRemoved([block.block_hash]))
            del self.cached[block.block_hash]
            block.block_hash = None
            block.token_ids = ()


class KVCacheManager:
    """Gives each request the blocks it needs, prefix-cache hits first.

    ``window``: where every layer of the model attends within a window (the largest one), a
    new token at position p reads no key before p - window + 1: the blocks wholly before that
    are released as the request moves on (to the free queue, still cached for prefix hits until
    evicted), and its table keeps their places, pointing at block 0 (never read: the attention
    paths mask or skip positions outside the window).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        hash_algo: str = "builtin",
        window: int | None = None,
        record_events: bool = False,
    ) -> None:
        if hash_algo not in BLOCK_HASHERS:
            raise ValueError(
                f"--prefix-caching-hash-algo must be one of {', '.join(BLOCK_HASHERS)}"
            )
        self.hash_block = BLOCK_HASHERS[hash_algo]
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching, record_events)
        self.window = window
        # a request's blocks in table order; None where one was released outside the window
        self.req_blocks: dict[str, list[KVBlock | None]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # leading blocks of a request already cached
        self.num_prefix_queries = 0  # tokens looked up in the prefix cache
        self.num_prefix_hits = 0  # tokens found there

    @property
    def enable_caching(self) -> bool:
        return self.pool.enable_caching

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def block_ids(self, request_id: str) -> list[int]:
        blocks = self.req_blocks.get(request_id, ())
        return [0 if block is None else block.block_id for block in blocks]

    def update_block_hashes(self, request: Request) -> None:
        """Extend ``request.block_hashes`` over every full block of its tokens."""
        size = self.block_size
        while len(request.block_hashes) < request.num_tokens // size:
            index = len(request.block_hashes)
            # the chain starts from the request's LoRA adapter (no block is shared across
            # adapters) and, for a longrope model, its factors
            lora = request.lora
            salt = lora and ("lora", lora.lora_id)
            if request.rope_long:  # another rotary, other KV for the same tokens
                salt = ("longrope", salt)
            parent = request.block_hashes[-1] if index else salt
            tokens = tuple(request.all_token_ids[index * size : (index + 1) * size])
            request.block_hashes.append(self.hash_block(parent, tokens))

    def get_computed_blocks(self, request: Request) -> list[KVBlock]:
        """The longest run of cached full blocks at the start of the request's tokens.

        At least one token is always left to compute, so the model can produce logits.
        """
        every_row = request.pooler_state is not None and request.pooler_state.needs_every_row
        if not self.enable_caching or request.params.prompt_logprobs is not None or every_row:
            return []  # prompt logprobs (and MEAN/CLS pooling) need every position computed
        self.update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for index, block_hash in enumerate(request.block_hashes[:max_blocks]):
            start = index * self.block_size
            tokens = tuple(request.all_token_ids[start : start + self.block_size])
            block = self.pool.get_cached_block(block_hash, tokens)
            if block is None:
                break
            hits.append(block)
        self.num_prefix_queries += request.num_tokens
        self.num_prefix_hits += len(hits) * self.block_size
        return hits

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: Sequence[KVBlock] = ()
    ) -> list[KVBlock] | None:
        """Make room for ``num_new_tokens`` more tokens; None (and no change) if blocks run out.

        ``computed_blocks`` are prefix hits from ``get_computed_blocks`` for a request that holds no
        blocks yet; their tokens count as computed.
        """
        blocks = self.req_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        num_required = -(-(num_computed + num_new_tokens) // self.block_size)
        num_new_blocks = num_required - len(blocks) - len(computed_blocks)
        num_evictable_hits = sum(1 for block in computed_blocks if block.ref_cnt == 0)
        if num_new_blocks + num_evictable_hits > self.pool.num_free_blocks:
            if not blocks:
                del self.req_blocks[request.request_id]
            return None
        self.pool.touch(computed_blocks)
        blocks.extend(computed_blocks)
        new_blocks = self.pool.get_new_blocks(max(num_new_blocks, 0))
        blocks.extend(new_blocks)
        self._cache_full_blocks(
            request, blocks, min(num_computed + num_new_tokens, request.num_tokens)
        )
        if self.window is not None:
            self._release_outside_window(blocks, num_computed)
        return new_blocks

    def _release_outside_window(self, blocks: list[KVBlock | None], num_computed: int) -> None:
        """Release the blocks no token from position ``num_computed`` on attends to."""
        first_needed = max(num_computed - self.window + 1, 0) // self.block_size
        released = [block for block in blocks[:first_needed] if block is not None]
        if released:
            blocks[:first_needed] = [None] * first_needed
            self.pool.free_blocks(released)

    def _cache_full_blocks(self, request: Request, blocks: list[KVBlock], num_tokens: int) -> None:
        if not self.enable_caching:
            return
        self.update_block_hashes(request)
        size = self.block_size
        first = self.num_cached_blocks.get(request.request_id, 0)
        run: list[int] = []  # indices of the blocks just cached, in a row
        for index in range(first, num_tokens // size):
            tokens = tuple(request.all_token_ids[index * size : (index + 1) * size])
            if self.pool.cache_block(blocks[index], request.block_hashes[index], tokens):
                run.append(index)
            elif run:
                self._record_stored(request, run)
                run = []
        if run:
            self._record_stored(request, run)
        self.num_cached_blocks[request.request_id] = max(first, num_tokens // size)

    def _record_stored(self, request: Request, indices: list[int]) -> None:
        """A ``BlockStored`` event for the request's consecutive blocks at ``indices``."""
        events = self.pool.events
        if events is None:
            return
        size, first = self.block_size, indices[0]
        lora = request.lora
        events.append(
            BlockStored(
                block_hashes=[request.block_hashes[index] for index in indices],
                parent_block_hash=request.block_hashes[first - 1] if first else None,
                token_ids=list(request.all_token_ids[first * size : (indices[-1] + 1) * size]),
                block_size=size,
                lora_id=lora.lora_id if lora is not None else None,
                lora_name=lora.name if lora is not None else None,
            )
        )

    def take_events(self) -> list[KVEvent]:
        """The prefix cache's changes since the last call ([] unless ``record_events``)."""
        return self.pool.take_events()

    def free(self, request: Request) -> None:
        """Release a request's blocks; its tail blocks are evicted first.

        Blocks are cached when allocated, for the tokens the step is about to compute; those
        holding tokens at or past ``request.num_computed_tokens`` (a request freed before its
        step ran: preempted after being scheduled) leave the cache, their KV never written.
        """
        blocks = self.req_blocks.pop(request.request_id, [])
        num_cached = self.num_cached_blocks.pop(request.request_id, 0)
        for block in blocks[request.num_computed_tokens // self.block_size : num_cached]:
            self.pool.uncache_block(block)  # after the window: never released before
        self.pool.free_blocks(block for block in reversed(blocks) if block is not None)

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
