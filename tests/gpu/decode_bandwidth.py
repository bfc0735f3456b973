"""The paged decode attention kernel's achieved bandwidth against the device's copy bandwidth.

A decode step reads every cached key and value of its sequences once; bytes read over the
kernel's time is its bandwidth. The reference is a plain device-to-device copy of a buffer as
large as the cache read (read + write bytes over its time). Prints one JSON line per context.
Needs a CUDA device: ``python tests/gpu/decode_bandwidth.py``.
"""

from __future__ import annotations

import json
import sys

import torch

from llmrpc.kernels.triton_attention import decode_attention


def _time_ms(fn, repeats: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]  # the median


def copy_bandwidth(num_bytes: int) -> float:
    """GB/s of a device-to-device copy of ``num_bytes`` (read plus written)."""
    source = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    return 2 * num_bytes / _time_ms(lambda: target.copy_(source)) / 1e6


def decode_bandwidth(num_seqs: int, context: int, block_size: int = 16) -> dict:
    """A Llama-3-8B-shaped layer (32 query heads, 8 KV heads of 128) in bfloat16."""
    heads, kv_heads, head_dim = 32, 8, 128
    blocks_per_seq = -(-context // block_size)
    num_blocks = num_seqs * blocks_per_seq
    shape = (num_blocks, block_size, kv_heads, head_dim)
    key_cache = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
    value_cache = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
    # each sequence's blocks spread over the cache, as a busy server's are
    tables = torch.randperm(num_blocks, device="cuda").view(num_seqs, blocks_per_seq)
    seq_lens = torch.full((num_seqs,), context, dtype=torch.int32, device="cuda")
    query = torch.randn(num_seqs, heads, head_dim, dtype=torch.bfloat16, device="cuda")
    milliseconds = _time_ms(
        lambda: decode_attention(query, key_cache, value_cache, tables, seq_lens, head_dim**-0.5)
    )
    num_bytes = 2 * num_seqs * context * kv_heads * head_dim * 2  # keys and values, 2 bytes
    achieved = num_bytes / milliseconds / 1e6
    reference = copy_bandwidth(num_bytes)
    return {
        "num_seqs": num_seqs,
        "context": context,
        "kernel_ms": round(milliseconds, 4),
        "kernel_GBps": round(achieved, 1),
        "copy_GBps": round(reference, 1),
        "ratio": round(achieved / reference, 3),
    }


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    for num_seqs, context in ((64, 4096), (32, 8192), (8, 32768), (256, 1024)):
        print(json.dumps(decode_bandwidth(num_seqs, context)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
