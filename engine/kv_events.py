"""The prefix cache's changes, as the engine core records them (``--kv-events-config``).

``sched.kv_cache.KVCacheManager`` records an event whenever a full block enters the prefix cache
(``BlockStored``: consecutive blocks of one prefix, their chained hashes and tokens), leaves it
(``BlockRemoved``: evicted for a new block, or its KV never written) or when the whole cache is
forgotten (``AllBlocksCleared``: a prefix cache reset, sleep). The step loop sends them to the
frontend after each step and command (``messages.KVEvents``), where ``client.kv_events.KVEventLog``
numbers them in batches for the gRPC subscribers (vLLM's event names and fields, so the smg
router reads them as it reads vLLM's).
"""

from __future__ import annotations

from typing import Union

import msgspec

BlockHash = Union[int, bytes]  # noqa: UP007 - msgspec wants a Union here


class BlockStored(msgspec.Struct, tag=True, array_like=True):
    block_hashes: list[BlockHash]  # in prefix order
    parent_block_hash: BlockHash | None  # the block before the first; None: a prompt's first
    token_ids: list[int]  # block_size tokens per block, in order
    block_size: int
    lora_id: int | None = None  # the LoRA adapter the blocks' KV was computed with
    lora_name: str | None = None


class BlockRemoved(msgspec.Struct, tag=True, array_like=True):
    block_hashes: list[BlockHash]


class AllBlocksCleared(msgspec.Struct, tag=True, array_like=True):
    pass


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]  # noqa: UP007
