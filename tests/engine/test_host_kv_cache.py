"""The KV cache in host memory: zero-filled, aligned, and resident only where blocks are used."""

from __future__ import annotations

from pathlib import Path

import torch
from engine_utils import run_to_completion

from llmrpc.engine.config import CacheConfig, EngineConfig, ModelConfig
from llmrpc.engine.core.engine_core import EngineCore
from llmrpc.engine.request import SamplingParams


def _resident_bytes(tensors: list[torch.Tensor]) -> int:
    """Resident memory of the mappings that hold ``tensors`` (``/proc/self/smaps``): the
    cache's own pages, whatever else the process holds or frees meanwhile."""
    spans = [(t.data_ptr(), t.data_ptr() + t.nbytes) for t in tensors]
    resident, holds = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):  # a mapping's first line: start-end ...
            start, end = (int(x, 16) for x in head.split("-"))
            holds = any(start < b and a < end for a, b in spans)
        elif holds and head == "Rss:":
            resident += int(line.split()[1]) * 1024
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
            assert tensor.is_contiguous() and tensor.data_ptr() % 64 == 0
            assert tensor.dtype == torch.float32
    key, value = caches[0]
    assert not key[:4].any() and not value[-4:].any()  # zeros, first and last blocks alike
    outputs = run_to_completion(
        core, {"a": ([1, 2, 3, 4, 5], SamplingParams(max_tokens=4, temperature=0.0))}
    )
    assert len(outputs["a"].token_ids) == 4
    assert caches[0][0].any()  # the request's keys went into the cache
