"""A prefill's linear layers in bfloat16: the packaged SmolLM2-135M's 120 body layers, fused as the
engine runs them (qkv, o, gate_up, down), each called with the same rows, through our blocked
dot-product kernel and through oneDNN's packed matmul. Passes alternate which goes first; the
fastest of 7 counts. Prints each kernel's time over the 120 layers and blocked / oneDNN.
Run: python tests/bench/prefill_linear_bench.py [threads] [rows] (1 and 512 by default);
docs/performance.md cites it."""

import sys
import time

import torch
from torch import nn
from transformers import AutoModelForCausalLM

from llmrpc.engine.loading.loader import resolve_model_dir
from llmrpc.kernels import cpu_ops
from llmrpc.kernels.linear_tuning import _module

KERNELS = ("blocked-avx512bf16", "onednn")


def fused(parts: list[nn.Linear]) -> nn.Linear:
    layer = nn.Linear(parts[0].in_features, sum(p.out_features for p in parts), bias=False)
    layer.weight = nn.Parameter(torch.cat([p.weight.detach() for p in parts]), requires_grad=False)
    return layer


@torch.inference_mode()
def main() -> None:
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    rows = int(sys.argv[2]) if len(sys.argv) > 2 else 512
    if not (cpu_ops.load() and torch.ops.llmrpc_cpu.bf16_linear_supported()):
        sys.exit("this CPU or build has no AVX512-BF16 blocked kernel")
    torch.set_num_threads(threads)
    cpu_ops.set_kernel_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(resolve_model_dir(None), dtype=torch.bfloat16)
    body = []
    for layer in model.model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        body += [
            fused([attention.q_proj, attention.k_proj, attention.v_proj]),
            attention.o_proj,
            fused([mlp.gate_proj, mlp.up_proj]),
            mlp.down_proj,
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
