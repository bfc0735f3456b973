"""A prefill's linear layers in bfloat16: the packaged SmolLM2-135M's 120 body layers as the engine
builds them (qkv, o, gate_up, down), each called with the same rows, through each of our blocked
kernels this CPU and build have for many rows and through oneDNN's packed matmul: in bfloat16 where
oneDNN computes it, else in float32 (the weights converted, twice the memory; the activations
converted each call), oneDNN's own linear layer on such a CPU. Passes alternate their order; the
fastest of 7 counts. Prints each kernel's time over the 120 layers and its ratio to oneDNN's.
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
from llmrpc.kernels.linear import PackedLinear, can_pack
from llmrpc.kernels.linear_tuning import ONE_ROW_KERNELS, _module, candidates


class Float32Linear(nn.Module):
    """oneDNN's packed float32 matmul on bfloat16 activations."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        wide = nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None)
        wide.weight.data = linear.weight.data.float()
        if linear.bias is not None:
            wide.bias.data = linear.bias.data.float()
        self.packed = PackedLinear(wide)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.packed(x.float()).bfloat16()


@torch.inference_mode()
def main() -> None:
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    rows = int(sys.argv[2]) if len(sys.argv) > 2 else 512
    if not cpu_ops.load():
        sys.exit("the C++ kernels did not load")
    torch.set_num_threads(threads)
    cpu_ops.set_kernel_threads(threads)
    folder = resolve_model_dir(None)
    model = build_model(AutoConfig.from_pretrained(folder), torch.bfloat16, iter_weights(folder))
    body = [
        module
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name.startswith("layers.")
    ]
    ours = [k for k in candidates(body[0]) if k != "onednn" and k not in ONE_ROW_KERNELS]
    modules = {kernel: [_module(layer, kernel) for layer in body] for kernel in ours}
    if can_pack(torch.bfloat16, torch.device("cpu")):
        reference = "oneDNN bfloat16"
        modules[reference] = [_module(layer, "onednn") for layer in body]
    else:
        reference = "oneDNN float32"
        modules[reference] = [Float32Linear(layer) for layer in body]
    generator = torch.Generator().manual_seed(0)
    xs = {
        n: torch.randn(rows, n, generator=generator).bfloat16()
        for n in {layer.in_features for layer in body}
    }
    best = dict.fromkeys(modules, float("inf"))
    for repeat in range(8):  # the first pass warms up
        for kernel in list(modules) if repeat % 2 else list(modules)[::-1]:
            start = time.perf_counter()
            for module, layer in zip(modules[kernel], body, strict=True):
                module(xs[layer.in_features])
            if repeat:
                best[kernel] = min(best[kernel], time.perf_counter() - start)
    print(f"{len(body)} layers, {rows} rows, {threads} threads:")
    for kernel, spent in best.items():
        print(f"  {kernel}: {spent * 1e3:.1f} ms, {spent / best[reference]:.3f} of {reference}'s")


if __name__ == "__main__":
    main()
