"""The paged decode attention kernel's achieved bandwidth against the device's copy bandwidth.

A decode step reads every cached key and value of its sequences once; bytes read over the
kernel's time is its bandwidth. The reference is a plain device-to-device copy of a buffer as
large as the cache read (read + write bytes over its time). Prints one JSON line per context.
Needs a CUDA device: ``python tests/gpu/decode_bandwidth.py [--json FILE]``; ``--small`` runs tiny
shapes on the CPU (Triton interpreted: the device check's dry run; its figures mean nothing).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from llmrpc.kernels.triton_attention import decode_attention

DEVICE = "cuda"


def _time_ms(fn, repeats: int = 20) -> float:
    if DEVICE == "cpu":
        fn()
        started = time.perf_counter()
        for _ in range(2):
            fn()
        return (time.perf_counter() - started) / 2 * 1e3
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
    source = torch.empty(num_bytes, dtype=torch.uint8, device=DEVICE)
    target = torch.empty_like(source)
    return 2 * num_bytes / _time_ms(lambda: target.copy_(source)) / 1e6


def decode_bandwidth(num_seqs: int, context: int, block_size: int = 16) -> dict:
    """A Llama-3-8B-shaped layer (32 query heads, 8 KV heads of 128) in bfloat16."""
    heads, kv_heads, head_dim = 32, 8, 128
    blocks_per_seq = -(-context // block_size)
    num_blocks = num_seqs * blocks_per_seq
    shape = (num_blocks, block_size, kv_heads, head_dim)
    key_cache = torch.randn(shape, dtype=torch.bfloat16, device=DEVICE)
    value_cache = torch.randn(shape, dtype=torch.bfloat16, device=DEVICE)
    # each sequence's blocks spread over the cache, as a busy server's are
    tables = torch.randperm(num_blocks, device=DEVICE).view(num_seqs, blocks_per_seq)
    seq_lens = torch.full((num_seqs,), context, dtype=torch.int32, device=DEVICE)
    query = torch.randn(num_seqs, heads, head_dim, dtype=torch.bfloat16, device=DEVICE)
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


# batch 1 and 4 at 32k, 64 x 4k (the targets), and two between
SHAPES = ((1, 32768), (4, 32768), (64, 4096), (32, 8192), (256, 1024))
SMALL_SHAPES = ((1, 64), (2, 48))


def main() -> int:
    global DEVICE
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--small", action="store_true", help="tiny shapes on the CPU")
    args = parser.parse_args()
    if args.small:
        DEVICE = "cpu"
    elif not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    results = []
    for num_seqs, context in SMALL_SHAPES if args.small else SHAPES:
        results.append(decode_bandwidth(num_seqs, context))
        print(json.dumps(results[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
