"""The KV cache in host memory: zero-filled, aligned, and resident only where blocks are used."""

from __future__ import annotations

from pathlib import Path

import torch
from engine_utils import run_to_completion

from llmrpc.engine.config import CacheConfig, EngineConfig, ModelConfig
from llmrpc.engine.core import EngineCore
from llmrpc.engine.request import SamplingParams


def _resident_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def test_a_large_host_cache_is_zero_aligned_and_resident_only_as_used(tiny_llama_dir: Path):
    before = _resident_bytes()
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
    grown = _resident_bytes() - before
    assert grown < cache_bytes / 8, (grown, cache_bytes)
    for key, value in caches:
        for tensor in (key, value):
            assert tensor.is_contiguous() and tensor.data_ptr() % 64 == 0
            assert tensor.dtype == torch.float32
    key, value = caches[0]
    assert not key[:4].any() and not value[-4:].any()  # zeros, first and last blocks alike
    outputs = run_to_completion(
        core, {"a": ([1, 2, 3, 4, 5], SamplingParams(max_tokens=4, temperature=0.0))}
    )
    assert len(outputs["a"].token_ids) == 4
    assert caches[0][0].any()  # the request's keys went into the cache
