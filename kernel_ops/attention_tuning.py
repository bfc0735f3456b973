"""Which path computes a prompt chunk's attention on the CPU: chosen by timing each candidate on
this machine, per attention shape and per bucket of the chunk's rows (as ``linear_tuning`` does
for the linear layers, in the same cache file).

The candidates (where the shape allows the first):
- ``cpp-prefill``: ``csrc/prefill_attention.cpp``, the keys and values read in place from the
  cache;
- ``torch-sdpa``: torch's ``scaled_dot_product_attention`` on the chunk's keys and values
  gathered from the cache (``attention._prefill_attention``; also the path of what the C++
  kernel does not take: attention windows, soft-capped scores, fp8 caches).

A prompt chunk reaches them only with a context past ``model_runner``'s rows-as-decodes limit, so
each bucket of ``ROW_BUCKETS`` past one row is timed at its ``TIMED_ROWS`` rows ending a context of
at least ``CONTEXT`` positions: one call per candidate, the fastest of ``REPEATS`` after a warm-up,
within ``BUDGET_S`` (a bucket left untimed takes the last timed bucket's choice, and is timed again
at the next start).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from llmrpc.kernels import attention
from llmrpc.kernels.linear_tuning import (
    REPEATS,
    ROW_BUCKETS,
    TIMED_ROWS,
    bucket_name,
    cached_or_timed,
    machine_key,
)

logger = logging.getLogger(__name__)

CONTEXT = 1024  # the least context a timed chunk ends
BUDGET_S = 2.0  # seconds of timing at start-up (the linear layers have 8)
MAX_ROWS = 2048  # the last bucket's rows (its chunks are at most max_num_batched_tokens long)


@dataclass(frozen=True)
class AttentionChoice:
    """What an attention shape's prompt chunks run: a path per bucket, and the times behind it."""

    shape: str
    num_layers: int
    kernels: tuple[str, ...]  # per bucket of ROW_BUCKETS (the first, one row, is a decode's)
    times_us: dict[str, list[float | None]]  # path -> per bucket (None: not timed)

    @property
    def op(self) -> str:
        return f"prefill attention {self.shape}"

    def describe(self) -> str:
        if len(self.times_us) < 2:
            return f"{self.op} ({self.num_layers} layers): {self.kernels[0]}, the one candidate"
        parts = []
        for index, kernel in enumerate(self.kernels[1:], 1):
            spent = self.times_us[kernel][index]
            shown = f" {spent:.0f} us" if spent is not None else " (untimed)"
            parts.append(f"{bucket_name(index)} rows {kernel}{shown}")
        return f"{self.op} ({self.num_layers} layers): " + ", ".join(parts)


@dataclass(frozen=True)
class Shape:
    """One attention shape of a model: its query heads and its layers' KV cache geometry."""

    num_heads: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def key(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return (
            f"{self.num_heads}/{self.num_kv_heads}x{self.head_dim} heads, blocks of "
            f"{self.block_size}, {dtype}"
        )


def candidates(shape: Shape) -> list[str]:
    cache = torch.empty(1, shape.block_size, shape.num_kv_heads, shape.head_dim, dtype=shape.dtype)
    query = torch.empty(1, shape.num_heads, shape.head_dim, dtype=shape.dtype)
    fits = attention.decode_kernel_fits(query, cache, cache) and attention.prefill_kernel_fits(
        cache
    )
    return ["cpp-prefill", "torch-sdpa"] if fits else ["torch-sdpa"]


def choose(shape: str, num_layers: int, times: dict[str, list[float | None]]) -> AttentionChoice:
    """Each bucket's fastest path; an untimed bucket keeps the last timed bucket's choice (the
    first, where none was timed, the torch path)."""
    kernels, previous = [], "torch-sdpa"
    for index in range(len(ROW_BUCKETS)):
        timed = [k for k in times if times[k][index] is not None]
        if timed:
            previous = min(timed, key=lambda k: times[k][index])
        kernels.append(previous)
    return AttentionChoice(shape, num_layers, tuple(kernels), times)


@torch.inference_mode()
def time_shape(
    shape: Shape, kernels: list[str], deadline: float, clock: Callable[[], float] = time.monotonic
) -> tuple[dict[str, list[float | None]], bool]:
    """Microseconds per call of each path in each bucket past one row (None: not timed); and
    whether the deadline left any bucket untimed."""
    times: dict[str, list[float | None]] = {k: [None] * len(ROW_BUCKETS) for k in kernels}
    generator = torch.Generator().manual_seed(0)
    longest = max(CONTEXT, MAX_ROWS)
    num_blocks = -(-longest // shape.block_size)
    size = (num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim)
    key_cache = torch.randn(size, generator=generator).to(shape.dtype)
    value_cache = torch.randn(size, generator=generator).to(shape.dtype)
    block_ids = torch.arange(num_blocks)
    scale = shape.head_dim**-0.5
    for index, rows in enumerate(TIMED_ROWS):
        if index == 0:  # one row: a decode
            continue
        if clock() > deadline:
            return times, True
        rows = min(rows, MAX_ROWS)
        context = max(rows, CONTEXT)
        query = torch.randn(rows, shape.num_heads, shape.head_dim, generator=generator)
        query = query.to(shape.dtype)
        output = torch.empty_like(query)
        seq = attention.PrefillSeq(0, rows, context, block_ids)
        for kernel in kernels:
            fastest = math.inf
            for repeat in range(REPEATS + 1):
                started = time.perf_counter()
                attention.prefill(query, key_cache, value_cache, seq, scale, output, kernel)
                if repeat:
                    fastest = min(fastest, time.perf_counter() - started)
            times[kernel][index] = fastest * 1e6
    return times, False


def plan_prefill_attention(
    num_heads: int, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], cache_folder: Path | None
) -> dict[str, AttentionChoice]:
    """The choice for each attention shape of a model with ``num_heads`` query heads and these
    layers' caches, set for ``attention``'s prompt chunks to follow; logged once."""
    groups: dict[str, tuple[Shape, int]] = {}
    for key_cache, _ in kv_caches:
        if key_cache.dim() != 4:  # an encoder's bookkeeping cache
            continue
        shape = Shape(num_heads, *key_cache.shape[1:], key_cache.dtype)
        known, count = groups.get(shape.key(), (shape, 0))
        groups[shape.key()] = (known, count + 1)
    times = cached_or_timed(
        ((key, [shape]) for key, (shape, _) in groups.items()),
        lambda shapes: candidates(shapes[0]),
        lambda shapes, kernels, deadline, clock: time_shape(shapes[0], kernels, deadline, clock),
        machine_key(),
        cache_folder,
        "prefill attention",
        budget_s=BUDGET_S,
    )
    plan = {}
    for key, shape_times in times.items():
        shape, count = groups[key]
        choice = choose(key, count, shape_times)
        attention.set_prefill_kernels(
            (shape.num_heads, shape.block_size, shape.num_kv_heads, shape.head_dim, shape.dtype),
            tuple(
                (last, kernel)
                for (_, last), kernel in zip(ROW_BUCKETS, choice.kernels, strict=True)
            ),
        )
        logger.info("attention kernels: %s", choice.describe())
        plan[key] = choice
    return plan
