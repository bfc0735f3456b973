"""The KV cache in host memory: zero-filled, aligned, on huge pages where Linux has them, and
resident only where blocks are used and in the margin faulted in ahead of them."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import time
from pathlib import Path

import pytest
import torch
from engine_utils import run_to_completion, vm_flags

from llmrpc.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from llmrpc.engine.core.engine_core import EngineCore
from llmrpc.engine.request import SamplingParams
from llmrpc.engine.runner.host_memory import (
    HUGE_PAGE,
    PopulateAhead,
    host_zeros,
    huge_page_buffer,
    huge_pages_available,
    populate,
)

_LIBC = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_PAGE = os.sysconf("SC_PAGE_SIZE")


def _resident_bytes(tensors: list[torch.Tensor]) -> int:
    """Resident memory of the pages ``tensors`` lie on (``mincore``): theirs alone, whatever
    mapping the kernel has merged them into."""
    resident = 0
    for tensor in tensors:
        start = tensor.data_ptr() - tensor.data_ptr() % _PAGE
        pages = -(-(tensor.data_ptr() + tensor.nbytes - start) // _PAGE)
        vector = (ctypes.c_ubyte * pages)()
        assert _LIBC.mincore(ctypes.c_void_p(start), ctypes.c_size_t(pages * _PAGE), vector) == 0
        resident += sum(byte & 1 for byte in vector) * _PAGE
    return resident


def test_a_large_host_cache_is_zero_aligned_and_resident_only_as_used(tiny_llama_dir: Path):
    core = EngineCore(
        EngineConfig(
            model=ModelConfig(model=str(tiny_llama_dir), dtype="float32", device="cpu"),
            cache=CacheConfig(kv_cache_memory_gib=2.0),
        )
    )
    caches = core.runner.kv_caches
    cache_bytes = sum(k.nbytes + v.nbytes for k, v in caches)
    assert cache_bytes > 1.9 * 2**30
    # The whole cache is there to be written, yet almost none of it is resident memory.
    tensors = [tensor for pair in caches for tensor in pair]
    resident = _resident_bytes(tensors)
    assert resident < cache_bytes / 8, (resident, cache_bytes)
    for key, value in caches:
        for tensor in (key, value):
            assert tensor.is_contiguous() and tensor.data_ptr() % HUGE_PAGE == 0
            assert tensor.storage_offset() == 0  # a compiled step would copy it every call
            assert tensor.dtype == torch.float32
            # A block's first write faults in 2 MiB at once: where each 4 KiB page faulted on its
            # own, a wave of new blocks cost a step 160 ms on a 2-core VM (docs/performance.md).
            if huge_pages_available():
                assert "hg" in vm_flags(tensor.data_ptr())
    key, value = caches[0]
    assert not key[:4].any() and not value[-4:].any()  # zeros, first and last blocks alike
    outputs = run_to_completion(
        core, {"a": ([1, 2, 3, 4, 5], SamplingParams(max_tokens=4, temperature=0.0))}
    )
    assert len(outputs["a"].token_ids) == 4
    assert caches[0][0].any()  # the request's keys went into the cache


def _wait_for(condition, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _can_populate() -> bool:
    buffer, _ = huge_page_buffer(HUGE_PAGE)
    return populate(buffer.data_ptr(), HUGE_PAGE)


@pytest.mark.skipif(not _can_populate(), reason="no MADV_POPULATE_WRITE (Linux before 5.14)")
def test_pages_are_faulted_in_up_to_the_wanted_block_and_no_byte_changes():
    """Two block-major tensors of 80 blocks of 512 KiB: the pages come in as the wanted count
    moves, never more than a huge page past it, and what a step wrote stays."""
    block = (128, 1024)  # 512 KiB of float32
    block_bytes = 128 * 1024 * 4
    tensors = [host_zeros((80, *block), torch.float32) for _ in range(2)]
    tensors[1][5].fill_(7.0)  # a block a step has written
    wanted = {"blocks": 0}
    ahead = PopulateAhead(tensors, lambda: wanted["blocks"], poll_s=0.01)
    try:
        time.sleep(0.2)
        assert ahead.populated == 0
        assert _resident_bytes(tensors) <= HUGE_PAGE  # the written block's page alone
        wanted["blocks"] = 30
        _wait_for(lambda: ahead.populated >= 30)
        resident = _resident_bytes(tensors)
        assert 2 * 30 * block_bytes <= resident <= 2 * (30 * block_bytes + 2 * HUGE_PAGE)
        wanted["blocks"] = 1000  # more than there are: all of them, then the thread ends
        _wait_for(lambda: not ahead._thread.is_alive())
        assert ahead.populated == 80
        assert _resident_bytes(tensors) == 2 * 80 * block_bytes
        assert torch.equal(tensors[1][5], torch.full(block, 7.0))
        tensors[1][5].zero_()
        assert not any(t.any() for t in tensors)
    finally:
        ahead.stop()


def test_stop_ends_the_thread_before_it_is_done():
    tensors = [host_zeros((80, 128, 1024), torch.float32)]
    ahead = PopulateAhead(tensors, lambda: 10, poll_s=0.01)
    ahead.stop()
    assert not ahead._thread.is_alive()
    assert ahead.populated < 80


@pytest.mark.skipif(not _can_populate(), reason="no MADV_POPULATE_WRITE (Linux before 5.14)")
def test_an_engine_keeps_its_host_cache_populated_ahead_of_the_blocks_in_use(tiny_llama_dir):
    """Start-up does not wait for it; then the margin (two steps' worth of new blocks) comes in
    on the idle thread, and moves with the blocks requests take. Sleep stops the thread and
    waking starts it again."""
    core = EngineCore(
        EngineConfig(
            model=ModelConfig(
                model=str(tiny_llama_dir), dtype="float32", device="cpu", enable_sleep_mode=True
            ),
            cache=CacheConfig(kv_cache_memory_gib=0.25),
            scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4),
        )
    )
    runner, pool = core.runner, core.kv_manager.pool
    margin = 2 * (64 // 16 + 4)
    assert pool.num_blocks > 4 * margin
    _wait_for(lambda: runner._populating.populated >= margin)
    tensors = [tensor for pair in runner.kv_caches for tensor in pair]
    block_bytes = tensors[0].stride(0) * tensors[0].element_size()
    assert _resident_bytes(tensors) >= len(tensors) * margin * block_bytes
    prompts = {str(i): (list(range(i, i + 40)), SamplingParams(max_tokens=30)) for i in range(3)}
    run_to_completion(core, prompts)
    assert pool.high_water >= 3 * 5
    _wait_for(lambda: runner._populating.populated >= pool.high_water + margin)
    core.sleep(1)
    assert runner._populating is None
    core.wake_up()
    _wait_for(lambda: runner._populating.populated >= pool.high_water + margin)
