"""A prefill's linear layers in bfloat16: the packaged SmolLM2-135M's 120 body layers as the engine
builds them (qkv, o, gate_up, down), each called with the same rows, through our blocked
dot-product kernel and through oneDNN's packed matmul. Passes alternate which goes first; the
fastest of 7 counts. Prints each kernel's time over the 120 layers and blocked / oneDNN.
Run: python tests/bench/prefill_linear_bench.py [threads] [rows] (1 and 512 by default);
docs/performance.md cites it."""

import sys
import time

import torch
from torch import nn
from transformers import AutoConfig

from llmrpc.engine.loading.loader import iter_weights, resolve_model_dir
from llmrpc.engine.models import build_model
from llmrpc.kernels import cpu_ops
from llmrpc.kernels.linear_tuning import _module

KERNELS = ("blocked-avx512bf16", "onednn")


@torch.inference_mode()
def main() -> None:
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    rows = int(sys.argv[2]) if len(sys.argv) > 2 else 512
    if not (cpu_ops.load() and torch.ops.llmrpc_cpu.bf16_linear_supported()):
        sys.exit("this CPU or build has no AVX512-BF16 blocked kernel")
    torch.set_num_threads(threads)
    cpu_ops.set_kernel_threads(threads)
    folder = resolve_model_dir(None)
    model = build_model(AutoConfig.from_pretrained(folder), torch.bfloat16, iter_weights(folder))
    body = [
        module
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name.startswith("layers.")
    ]
    modules = {kernel: [_module(layer, kernel) for layer in body] for kernel in KERNELS}
    generator = torch.Generator().manual_seed(0)
    xs = {
        n: torch.randn(rows, n, generator=generator).bfloat16()
        for n in {layer.in_features for layer in body}
    }
    best = dict.fromkeys(KERNELS, float("inf"))
    for repeat in range(8):  # the first pass warms up
        for kernel in KERNELS if repeat % 2 else KERNELS[::-1]:
            start = time.perf_counter()
            for module, layer in zip(modules[kernel], body, strict=True):
                module(xs[layer.in_features])
            if repeat:
                best[kernel] = min(best[kernel], time.perf_counter() - start)
    blocked, onednn = best["blocked-avx512bf16"], best["onednn"]
    print(
        f"{len(body)} layers, {rows} rows, {threads} threads: blocked {blocked * 1e3:.1f} ms, "
        f"oneDNN {onednn * 1e3:.1f} ms, blocked / oneDNN {blocked / onednn:.3f}"
    )


if __name__ == "__main__":
    main()
