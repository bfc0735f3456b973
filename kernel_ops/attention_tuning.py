"""Which path computes attention on the CPU, for prompt chunks and for a step's decode rows:
chosen by timing each candidate on this machine, per attention shape and per bucket of rows (as
``linear_tuning`` does for the linear layers, in the same cache file).

A prompt chunk's candidates (where the shape allows the first):
- ``cpp-prefill``: ``csrc/prefill_attention.cpp``, the keys and values read in place from the
  cache;
- ``torch-sdpa``: torch's ``scaled_dot_product_attention`` on the chunk's keys and values
  gathered from the cache (``attention._prefill_attention``; also the path of what the C++
  kernel does not take: attention windows, soft-capped scores, fp8 caches).

A prompt chunk reaches them only with a context past ``model_runner``'s rows-as-decodes limit, so
each bucket of ``ROW_BUCKETS`` past one row is timed at its ``TIMED_ROWS`` rows ending a context of
at least ``CONTEXT`` positions.

A step's decode rows (decodes, and the rows of prompt chunks short enough to run as decodes),
where the shape allows the first:
- ``cpp-decode``: ``csrc/decode_attention.cpp``, every row in one call, the keys and values read
  in place (also the kernel inside the fused qkv/attention and whole-layer calls, which steps
  whose rows torch's path takes do without);
- ``torch-sdpa``: the rows' blocks gathered, then one ``scaled_dot_product_attention``
  (``attention.decode_attention_torch``).

Each bucket up to 1024 rows is timed at its ``DECODE_ROWS`` rows of ``DECODE_CONTEXT`` positions,
their blocks scattered over at most ``DECODE_BYTES`` of cache, as a step's lie scattered; more
rows take the 129-1024 bucket's choice. Each candidate's time in a bucket is its fastest call of
``linear_tuning.REPEATS`` after a warm-up, or of as many as take ``MIN_SECONDS`` (at most 64), but
no more once past that where it took over twice another's time; all within ``BUDGET_S`` for both
stages (a bucket left untimed takes the last timed bucket's choice, and is timed again at the next
start). The decode kernel keeps a bucket unless torch's path took under ``DECODE_EDGE`` of its
time. So that large shapes fit the budget, a bucket whose call would pass ``PREFILL_FLOP`` or read
more than ``DECODE_BYTES`` of keys is timed at fewer rows, never under its first.
``--batch-invariant`` plans no decode rows: they take the C++ kernel, whose rows do not depend on
each other.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from llmrpc.kernels import attention
from llmrpc.kernels.linear_tuning import (
    ROW_BUCKETS,
    TIMED_ROWS,
    bucket_name,
    cached_or_timed,
    call_time,
    machine_key,
)

logger = logging.getLogger(__name__)

CONTEXT = 1024  # the least context a timed chunk ends
BUDGET_S = 2.0  # seconds of timing at start-up, both stages (the linear layers have 8)
MAX_ROWS = 2048  # the last bucket's rows (its chunks are at most max_num_batched_tokens long)
PREFILL_FLOP = 16e9  # per timed chunk: past it a bucket is timed at fewer rows, from its first
DECODE_ROWS = (1, 8, 32, 128, 256)  # per bucket (256: the default --max-num-seqs; past 1024 none)
DECODE_CONTEXT = 512  # positions of each timed decode row
# the most keys a timed decode call reads (past it a bucket is timed at fewer rows, from its
# first), and the most cache of keys, and of values, its rows' blocks are drawn from
DECODE_BYTES = 64 * 2**20
MIN_SECONDS = 0.02  # each candidate's timed calls in a bucket, at the least (short calls: more)
# Decode rows take torch's path only where it took under this share of the C++ kernel's time:
# the kernel's rows also keep the fused qkv/attention and whole-layer calls and the compiled
# step, whose gains a timing of attention alone does not see.
DECODE_EDGE = 0.8
# the path of a shape or bucket of each stage no measurement decides
UNMEASURED = {"prefill": "torch-sdpa", "decode": "cpp-decode"}


@dataclass(frozen=True)
class AttentionChoice:
    """What an attention shape's prompt chunks (``stage`` "prefill") or a step's decode rows
    ("decode") run: a path per bucket, and the times behind it."""

    stage: str
    shape: str
    num_layers: int
    kernels: tuple[str, ...]  # per bucket of ROW_BUCKETS
    times_us: dict[str, list[float | None]]  # path -> per bucket (None: not timed)

    @property
    def op(self) -> str:
        return f"{self.stage} attention {self.shape}"

    @property
    def first_bucket(self) -> int:
        """A prompt chunk's attention is planned from two rows (a one-row bucket is a decode's)."""
        return 1 if self.stage == "prefill" else 0

    def describe(self) -> str:
        if len(self.times_us) < 2:
            return f"{self.op} ({self.num_layers} layers): {self.kernels[0]}, the one candidate"
        parts = []
        for index in range(self.first_bucket, len(self.kernels)):
            kernel, spent = self.kernels[index], self.times_us[self.kernels[index]][index]
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


def candidates(shape: Shape, stage: str) -> list[str]:
    cache = torch.empty(1, shape.block_size, shape.num_kv_heads, shape.head_dim, dtype=shape.dtype)
    query = torch.empty(1, shape.num_heads, shape.head_dim, dtype=shape.dtype)
    if not attention.decode_kernel_fits(query, cache, cache):
        return ["torch-sdpa"]
    if stage == "decode":
        return ["cpp-decode", "torch-sdpa"]
    return ["cpp-prefill", "torch-sdpa"] if attention.prefill_kernel_fits(cache) else ["torch-sdpa"]


def choose(
    stage: str, shape: str, num_layers: int, times: dict[str, list[float | None]]
) -> AttentionChoice:
    """Each bucket's fastest path (the C++ decode kernel's time counted at ``DECODE_EDGE`` of
    itself); an untimed bucket keeps the last timed bucket's choice (the first, where none was
    timed, the stage's ``UNMEASURED`` path, or the one candidate)."""
    previous = UNMEASURED[stage] if UNMEASURED[stage] in times else next(iter(times))
    edge = {"cpp-decode": DECODE_EDGE}
    kernels = []
    for index in range(len(ROW_BUCKETS)):
        timed = [k for k in times if times[k][index] is not None]
        if timed:
            previous = min(timed, key=lambda k: times[k][index] * edge.get(k, 1.0))
        kernels.append(previous)
    return AttentionChoice(stage, shape, num_layers, tuple(kernels), times)


def _prefill_flop(shape: Shape, rows: int) -> int:
    """A timed chunk's attention work: two products of its rows and context, every head."""
    return 4 * rows * max(rows, CONTEXT) * shape.num_heads * shape.head_dim


def _random(size, dtype, generator) -> torch.Tensor:
    return torch.randn(size, generator=generator).to(dtype)


@torch.inference_mode()
def time_shape(
    shape: Shape,
    stage: str,
    kernels: list[str],
    deadline: float,
    clock: Callable[[], float] = time.monotonic,
) -> tuple[dict[str, list[float | None]], bool]:
    """Microseconds per call of each path in each bucket ``stage`` times (None: not timed); and
    whether the deadline left any bucket untimed."""
    times: dict[str, list[float | None]] = {k: [None] * len(ROW_BUCKETS) for k in kernels}
    generator = torch.Generator().manual_seed(0)
    scale = shape.head_dim**-0.5
    per_block = (shape.block_size, shape.num_kv_heads, shape.head_dim)
    firsts = [first for first, _ in ROW_BUCKETS]
    if stage == "decode":
        blocks_per_row = -(-DECODE_CONTEXT // shape.block_size)
        block_bytes = math.prod(per_block) * shape.dtype.itemsize
        most = DECODE_BYTES // (blocks_per_row * block_bytes)
        timed_rows = [
            max(first, min(rows, most))
            for first, rows in zip(firsts[: len(DECODE_ROWS)], DECODE_ROWS, strict=True)
        ]
        num_blocks = min(
            max(timed_rows) * blocks_per_row, max(DECODE_BYTES // block_bytes, blocks_per_row)
        )
    else:
        num_blocks = -(-max(CONTEXT, MAX_ROWS) // shape.block_size)
        timed_rows = [None]  # (one row: a decode's)
        for first, rows in zip(firsts[1:], TIMED_ROWS[1:], strict=True):
            rows = min(rows, MAX_ROWS)
            while rows > first and _prefill_flop(shape, rows) > PREFILL_FLOP:
                rows = max(first, rows // 2)
            timed_rows.append(rows)
    key_cache = _random((num_blocks, *per_block), shape.dtype, generator)
    value_cache = _random((num_blocks, *per_block), shape.dtype, generator)
    for index, rows in enumerate(timed_rows):
        if rows is None:
            continue
        if clock() > deadline:
            return times, True
        query = _random((rows, shape.num_heads, shape.head_dim), shape.dtype, generator)
        if stage == "decode":
            needed = rows * blocks_per_row
            if needed <= num_blocks:  # each row's blocks its own, scattered
                tables = torch.randperm(num_blocks, generator=generator)[:needed]
            else:  # drawn from the pool, some more than once
                tables = torch.randint(num_blocks, (needed,), generator=generator)
            tables = tables.view(rows, blocks_per_row)
            metadata = attention.AttentionMetadata(
                slot_mapping=torch.empty(0, dtype=torch.long),
                decode_indices=torch.arange(rows),
                decode_block_tables=tables,
                decode_seq_lens=torch.full((rows,), DECODE_CONTEXT),
                prefills=[],
            )
            call = functools.partial(
                attention.decode, query, key_cache, value_cache, metadata, scale
            )
        else:
            output = torch.empty_like(query)
            seq = attention.PrefillSeq(0, rows, max(rows, CONTEXT), torch.arange(num_blocks))
            call = functools.partial(
                attention.prefill, query, key_cache, value_cache, seq, scale, output
            )
        for kernel in kernels:
            best = min((t[index] for t in times.values() if t[index] is not None), default=math.inf)
            times[kernel][index] = call_time(
                functools.partial(call, kernel=kernel), best_us=best, min_seconds=MIN_SECONDS
            )
    return times, False


def plan_attention(
    num_heads: int,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    cache_folder: Path | None,
    stages: tuple[str, ...] = ("prefill", "decode"),
) -> dict[str, AttentionChoice]:
    """The choice for each attention shape and stage of a model with ``num_heads`` query heads
    and these layers' caches, set for ``attention`` to follow; logged once."""
    groups: dict[str, tuple[Shape, int]] = {}
    for key_cache, _ in kv_caches:
        if key_cache.dim() != 4:  # an encoder's bookkeeping cache
            continue
        shape = Shape(num_heads, *key_cache.shape[1:], key_cache.dtype)
        known, count = groups.get(shape.key(), (shape, 0))
        groups[shape.key()] = (known, count + 1)
    # timed per stage and shape, keyed in the cache file by the choice's op
    timed = {
        f"{stage} attention {key}": (stage, shape)
        for stage in stages
        for key, (shape, _) in groups.items()
    }

    def kernels_of(items: list[tuple[str, Shape]]) -> list[str]:
        ((stage, shape),) = items
        return candidates(shape, stage)

    def time_one(items: list[tuple[str, Shape]], kernels, deadline, clock):
        ((stage, shape),) = items
        return time_shape(shape, stage, kernels, deadline, clock)

    times = cached_or_timed(
        ((name, [item]) for name, item in timed.items()),
        kernels_of,
        time_one,
        machine_key(),
        cache_folder,
        "attention",
        budget_s=BUDGET_S,
    )
    plan = {}
    for name, shape_times in times.items():
        stage, shape = timed[name]
        choice = choose(stage, shape.key(), groups[shape.key()][1], shape_times)
        if len(shape_times) > 1:  # (one candidate: the path the stage takes unplanned)
            dims = (shape.num_heads, shape.block_size, shape.num_kv_heads, shape.head_dim)
            attention.set_kernels(
                stage,
                (*dims, shape.dtype),
                tuple(
                    (last, kernel)
                    for (_, last), kernel in zip(ROW_BUCKETS, choice.kernels, strict=True)
                ),
            )
        logger.info("attention kernels: %s", choice.describe())
        plan[name] = choice
    return plan
