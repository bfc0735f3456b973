"""The blocked int4 and int8-code layers on SmolLM2-135M's four body shapes, one thread by default:
GMAC/s over the four (random weights, hot in the cache; the fastest of 7 passes) at 1, 8, 32 and
128 rows; then one row through 120 int4 layers (the 30 layers' four shapes, each weight read from
memory as in a one-stream decode step), the median of 30 passes. Run: python
tests/bench/kernel_bench.py [threads]; docs/performance.md cites it."""

import sys
import time

import torch

from llmrpc.engine.quantization.layers import Int4Linear, Q8Linear, blocked_kernel_available

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down


def best_seconds(call, repeats: int) -> float:
    call()
    best = float("inf")
    for _ in range(7):
        start = time.perf_counter()
        for _ in range(repeats):
            call()
        best = min(best, (time.perf_counter() - start) / repeats)
    return best


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
    if not blocked_kernel_available():
        sys.exit("this build has no blocked int4 kernel (it takes AVX2 and FMA)")
    kinds = {
        "int4": [Int4Linear.from_float(torch.randn(o, i), None, torch.bfloat16) for o, i in SHAPES],
        "int8 codes": [
            Q8Linear.from_blocks(
                torch.randint(-127, 128, (o, i), dtype=torch.int8), torch.rand(o, i // 32) / 100
            )
            for o, i in SHAPES
        ],
    }
    for kind, layers in kinds.items():
        figures = []
        for rows in (1, 8, 32, 128):
            xs = [torch.randn(rows, i).bfloat16() for _, i in SHAPES]
            seconds = sum(
                best_seconds(lambda layer=layer, x=x: layer.packed_matmul(x), max(10, 1500 // rows))
                for layer, x in zip(layers, xs, strict=True)
            )
            macs = rows * sum(o * i for o, i in SHAPES)
            figures.append(f"{rows} rows {macs / seconds / 1e9:.1f}")
        split = " (split nibbles)" if getattr(layers[0], "split", False) else ""
        print(f"{kind}{split}: " + ", ".join(figures) + " GMAC/s")
    body = [Int4Linear.from_float(torch.randn(o, i), None, torch.bfloat16) for o, i in SHAPES * 30]
    xs = [torch.randn(1, i).bfloat16() for _, i in SHAPES * 30]
    weight_bytes = sum(layer.qweight.nbytes + layer.scales_and_zeros.nbytes for layer in body)
    times = []
    for _ in range(31):
        start = time.perf_counter()
        for layer, x in zip(body, xs, strict=True):
            layer.packed_matmul(x)
        times.append(time.perf_counter() - start)
    median = sorted(times[1:])[15]
    print(
        f"one row through 120 int4 layers ({weight_bytes / 1e6:.0f} MB): {median * 1e3:.2f} ms, "
        f"{weight_bytes / median / 1e9:.1f} GB/s"
    )


if __name__ == "__main__":
    main()
