"""A prompt chunk's attention on the CPU: the C++ prefill kernel against torch's
scaled_dot_product_attention on the gathered cache (the two paths of kernel_ops/attention.py's
``prefill``), for SmolLM2-135M's heads (9 query heads over 3 KV heads of 64, blocks of 16) in the
given dtype, at chunks of a whole prompt and ends of long ones. Calls alternate which path goes
first; the fastest of 7 counts. Prints each path's time, its GFLOP/s and torch's time / ours.
Run: python tests/bench/prefill_attention_bench.py [threads] [dtype] (2 and bfloat16 by default);
docs/performance.md cites it."""

import functools

import torch
from alternate import fastest, setup

from llmrpc.kernels.attention import PrefillSeq, prefill

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
CASES = ((512, 512), (2048, 2048), (4000, 1952), (4096, 256))  # (context, chunk rows)
PATHS = ("cpp-prefill", "torch-sdpa")


@torch.inference_mode()
def main() -> None:
    threads, dtype = setup()
    generator = torch.Generator().manual_seed(0)
    for context, rows in CASES:
        num_blocks = -(-context // BLOCK)
        shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
        caches = [torch.randn(shape, generator=generator).to(dtype) for _ in range(2)]
        query = torch.randn(rows, HEADS, HEAD_DIM, generator=generator).to(dtype)
        seq = PrefillSeq(0, rows, context, torch.randperm(num_blocks, generator=generator))
        output = torch.empty_like(query)
        best = fastest(
            PATHS, functools.partial(prefill, query, *caches, seq, HEAD_DIM**-0.5, output)
        )
        flop = 4 * HEADS * HEAD_DIM * rows * (context - rows / 2)  # causal: about half the pairs
        shown = ", ".join(
            f"{p} {t * 1e3:.1f} ms ({flop / t / 1e9:.0f} GFLOP/s)" for p, t in best.items()
        )
        ratio = best["torch-sdpa"] / best["cpp-prefill"]
        print(
            f"{dtype} context {context}, {rows} rows, {threads} threads: {shown}; "
            f"torch/ours {ratio:.2f}"
        )


if __name__ == "__main__":
    main()
