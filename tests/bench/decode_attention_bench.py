"""A decode step's attention on the CPU: the C++ decode kernel against torch's path (each row's
blocks gathered from the cache, then scaled_dot_product_attention), each as
kernel_ops/attention.py's ``decode`` runs it, for SmolLM2-135M's heads (9 query heads over 3 KV
heads of 64, blocks of 16) or the heads given as HEADS/KV_HEADSxHEAD_DIM (Llama-3-8B's: 32/8x128)
in the given dtype, at batches of 1 to 256 sequences. Calls alternate which path goes first; the
fastest of 7 counts. Prints each path's time and torch's time / ours. (The engine times the two
at its first start, kernel_ops/attention_tuning.py.)
Run: python tests/bench/decode_attention_bench.py [threads] [dtype] [heads] (2, bfloat16 and
9/3x64 by default); docs/performance.md cites it."""

import functools
import sys
from types import SimpleNamespace

import torch
from alternate import fastest, setup

from llmrpc.kernels.attention import decode

BLOCK = 16
CASES = ((1, 1024), (1, 4096), (8, 1024), (32, 1024), (128, 1024), (256, 512))  # (rows, context)
PATHS = ("cpp-decode", "torch-sdpa")


def attend(query, keys, values, tables, lens, scale, path: str) -> torch.Tensor:
    metadata = SimpleNamespace(decode_block_tables=tables, decode_seq_lens=lens)
    return decode(query, keys, values, metadata, scale, path)


@torch.inference_mode()
def main() -> None:
    threads, dtype = setup()
    heads, head_dim = (sys.argv[3] if len(sys.argv) > 3 else "9/3x64").split("x")
    num_heads, kv_heads = map(int, heads.split("/"))
    head_dim = int(head_dim)
    generator = torch.Generator().manual_seed(0)
    scale = head_dim**-0.5
    for rows, context in CASES:
        num_blocks = rows * -(-context // BLOCK)
        shape = (num_blocks, BLOCK, kv_heads, head_dim)
        keys, values = (torch.randn(shape, generator=generator).to(dtype) for _ in range(2))
        tables = torch.randperm(num_blocks, generator=generator).view(rows, -1)
        lens = torch.full((rows,), context, dtype=torch.long)
        query = torch.randn(rows, num_heads, head_dim, generator=generator).to(dtype)
        best = fastest(PATHS, functools.partial(attend, query, keys, values, tables, lens, scale))
        shown = ", ".join(f"{p} {t * 1e6:.0f} us" for p, t in best.items())
        ratio = best["torch-sdpa"] / best["cpp-decode"]
        print(
            f"{dtype} {num_heads}/{kv_heads}x{head_dim} heads, {rows} rows of {context} "
            f"positions, {threads} threads: {shown}; torch/ours {ratio:.2f}"
        )


if __name__ == "__main__":
    main()
