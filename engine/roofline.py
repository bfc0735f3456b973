"""The memory-bandwidth roofline of decoding: how fast a step could be if it only read memory.

A decode step reads every weight of the model once, whatever its batch, and each sequence's
cached keys and values once. On a CPU those reads dominate a small batch, so
``bandwidth / bytes a step reads`` bounds its speed, and the fraction of that bound a run
reaches says how much of the step is fixed cost (Python, kernel launches, the sampler) instead
of reading. ``llmrpc bench throughput --roofline`` prints it beside its measurement.
"""

from __future__ import annotations

import dataclasses
import time

import torch
from torch import nn

from llmrpc.engine.runner.host_memory import huge_page_buffer

# Large enough to come from memory on any CPU (a last-level cache is at most a few hundred MB).
_READ_BYTES = 1 << 30
_READ_REPEATS = 5


def read_bandwidth(num_bytes: int = _READ_BYTES, repeats: int = _READ_REPEATS) -> float:
    """Bytes per second of summing a float32 buffer of ``num_bytes`` on torch's current thread
    count, held as the engine holds its weights (``weight_arena``: on huge pages where Linux
    has them; on 4 KiB pages the same sum read 36 GB/s, on 2 MiB pages 39, on one thread of the
    AMD EPYC of docs/performance.md): the best of ``repeats`` reads after one that faults the
    pages in."""
    raw, _ = huge_page_buffer(num_bytes // 4 * 4)
    buffer = raw.view(torch.float32).fill_(1.0)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - start)
    return buffer.nbytes / best


def _own_tensors(module: nn.Module):
    """A module's own parameters and buffers, and tensors it holds as plain attributes (packed
    weights: ``BlockedLinear.weight_blocks``, ``PackedLinear.packed_weight``)."""
    yield from module.parameters(recurse=False)
    yield from module.buffers(recurse=False)
    for value in vars(module).values():
        if isinstance(value, torch.Tensor):
            yield value


def _identity(tensor: torch.Tensor):
    """One key per tensor's memory, so a tied head and its embedding count once (and the
    weights, which share one buffer, each count: ``weight_arena``)."""
    if tensor.is_mkldnn:  # an opaque oneDNN tensor has no storage to compare
        return ("opaque", id(tensor))
    return ("memory", tensor.data_ptr(), tensor.nbytes)


def _bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def weight_bytes_per_step(model: nn.Module) -> int:
    """Bytes of weights one decode step reads: every tensor of every module, but of a tensor only
    embeddings hold, one row (a step reads one row per token; a tied head reads it whole)."""
    embeddings = {m for m in model.modules() if isinstance(m, nn.Embedding)}
    tensors: dict = {}
    holders: dict = {}
    for module in model.modules():
        for tensor in _own_tensors(module):
            key = _identity(tensor)
            tensors[key] = tensor
            holders.setdefault(key, set()).add(module)
    return sum(
        _bytes(tensor) // tensor.shape[0] if holders[key] <= embeddings else _bytes(tensor)
        for key, tensor in tensors.items()
    )


@dataclasses.dataclass(frozen=True)
class Roofline:
    """The bound for decoding ``batch`` sequences at a mean context of ``context`` tokens."""

    bandwidth: float  # bytes/s
    threads: int
    weight_bytes: int  # read once a step
    kv_bytes_per_token: int  # of context, every layer's keys and values
    batch: int
    context: float

    @property
    def step_bytes(self) -> float:
        return self.weight_bytes + self.batch * self.context * self.kv_bytes_per_token

    @property
    def tokens_per_second(self) -> float:
        """Output tokens a second if a step took only its reads."""
        return self.batch * self.bandwidth / self.step_bytes

    def line(self, measured: float) -> str:
        return (
            f"roofline: read {self.bandwidth / 1e9:.1f} GB/s on {self.threads} thread"
            f"{'' if self.threads == 1 else 's'}; a decode step of {self.batch} reads "
            f"{self.step_bytes / 1e6:.1f} MB ({self.weight_bytes / 1e6:.1f} MB of weights, KV "
            f"at a mean context of {self.context:.0f}) -> {self.tokens_per_second:.1f} tok/s; "
            f"decode measured {measured:.1f} tok/s = {100 * measured / self.tokens_per_second:.0f}%"
        )
