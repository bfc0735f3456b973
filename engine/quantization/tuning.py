"""Up to how many rows a call each quantized layer runs its packed kernel: measured on this
machine, per layer kind and shape, against the dense path (the weight dequantized for the call,
then ``torch.nn.functional.linear``, oneDNN's matmul: AMX where the CPU has it). Where the CPU
has AMX tiles, the packed kernel's tile path (a few blocks dequantized at a time, then bfloat16
tiles) is timed beside its integer dot products, and the layer takes it from the row count where
the two cost the same (``tiles_from``, between the timed rows of the last bucket the dot
products won and the first the tiles won, as two straight lines of cost against rows cross).

A packed kernel reads the quantized weight once for all of a call's rows; the dense path pays a
dequantization a call and then runs the library's matmul, which wins once enough rows share
that cost. Where the crossover falls depends on the CPU (whether the library has AMX tiles to
use, what the memory gives), so it is timed: each bucket of ``ROW_BUCKETS`` at ``TIMED_ROWS``
rows on one layer of the shape, both paths, the fastest of ``REPEATS`` calls. A layer then takes
its packed kernel for the leading buckets where that won (``dense_above``: the last row of the
last of them), dense past it. Buckets the budget or the FLOP cap leave untimed take the last
timed bucket's choice; a layer of more than ``MAX_TIMED_BYTES`` is not timed, and keeps its
kind's default. Only layers computing in bfloat16 are timed (in float16 and float32 every call
is dense). Measurements are cached with the float layers' (``kernels.linear_tuning``),
keyed by the same machine key.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from llmrpc.engine.quantization.layers import (
    _FAST_DTYPES,
    Int4Linear,
    Q8Linear,
    QuantizedLinear,
    packed_bytes,
)
from llmrpc.kernels.linear_tuning import (
    MAX_FLOP,
    ROW_BUCKETS,
    TIMED_ROWS,
    LayerChoice,
    cached_or_timed,
    call_time,
    machine_key,
)

logger = logging.getLogger(__name__)

BUDGET_S = 6.0
# A larger layer (an embedding or head over a large vocabulary, read a few rows a call) is not
# timed: its dequantization alone takes seconds. It keeps its kind's default.
MAX_TIMED_BYTES = 64 * 2**20
EVERY_ROW_COUNT = 2**31 - 1  # dense_above where the packed kernel won every bucket timed


def shape_key(layer: QuantizedLinear) -> str:
    """The kind, packing and shape of a quantized layer (what its timing depends on)."""
    kind = type(layer).__name__
    if isinstance(layer, Int4Linear):
        kind += " blocked" if layer.blocked else " torch-packed"
    elif isinstance(layer, Q8Linear):
        planes = "a zero per 32" if layer.zeros else "a scale per 16"
        kind += f" ({planes})" if layer.scales.dim() == 4 else ""
    return f"{kind} {layer.dtype} {layer.in_features}x{layer.out_features}"


def kernels(layer: QuantizedLinear) -> list[str]:
    """The paths timed for ``layer``: its packed kernel's dot products, its tile path where it
    has one, and the dense path."""
    return ["packed", "tiles", "dense"] if layer.has_tiles else ["packed", "dense"]


@torch.inference_mode()
def time_layer(
    layer: QuantizedLinear, deadline: float, clock: Callable[[], float] = time.monotonic
) -> tuple[dict[str, list[float | None]], bool]:
    """Microseconds of each path in each bucket (None: not timed), and whether the deadline cut
    it short. The dense path's time is its dequantization's (timed once: it does not depend on
    the rows) plus the matmul's on the dequantized weight; where the packed call took less than
    the dequantization alone, the matmul is not timed and the dense time given is the
    dequantization's (a lower bound: a large embedding's dequantization takes most of a second).
    Past the first bucket the packed kernel (the faster of its two paths) loses its place once 3x
    behind (its cost grows with the rows faster than the matmul's)."""
    times: dict[str, list[float | None]] = {k: [None] * len(ROW_BUCKETS) for k in kernels(layer)}
    if packed_bytes(layer) > MAX_TIMED_BYTES:
        return times, False
    weight = layer.dequantize(layer.dtype)  # a warm-up, and the matmul's weight
    started = time.perf_counter()
    layer.dequantize(layer.dtype)
    dequantize_us = (time.perf_counter() - started) * 1e6
    flop_per_row = 2 * layer.in_features * layer.out_features
    generator = torch.Generator().manual_seed(0)
    packed = True
    for index, rows in enumerate(TIMED_ROWS):
        rows = max(ROW_BUCKETS[index][0], min(rows, int(MAX_FLOP // flop_per_row)))
        if rows * flop_per_row > 4 * MAX_FLOP:
            break
        if clock() > deadline:
            return times, True
        x = torch.randn(rows, layer.in_features, generator=generator).to(layer.dtype)
        packed_us = None
        if packed:
            times["packed"][index] = call_time(functools.partial(layer.packed_matmul, x, 0))
            if "tiles" in times:
                times["tiles"][index] = call_time(functools.partial(layer.packed_matmul, x, 1))
            packed_us = _packed_time(times, index)
        if packed_us is not None and packed_us < dequantize_us:
            # the dequantization alone is slower: its time stands for the dense path's (a lower
            # bound), the matmul untimed
            times["dense"][index] = dequantize_us
        else:
            matmul_us = call_time(functools.partial(F.linear, x, weight))
            times["dense"][index] = dequantize_us + matmul_us
        packed = packed_us is not None and packed_us <= 3 * times["dense"][index]
    return times, False


def _packed_time(times: dict[str, list[float | None]], index: int) -> float | None:
    """The faster of the packed kernel's paths in bucket ``index`` (None: neither timed)."""
    timed = [times[k][index] for k in ("packed", "tiles") if k in times]
    timed = [t for t in timed if t is not None]
    return min(timed) if timed else None


def choose(shape: str, num_layers: int, times: dict[str, list[float | None]]) -> LayerChoice:
    """The packed kernel (its dot products, or its tiles where they were faster) for the leading
    buckets where it was timed faster than dense, dense from the first where it was not (or had
    dropped out); untimed buckets take the last timed bucket's choice."""
    chosen, packed, path = [], True, "packed"
    for index, dense_us in enumerate(times["dense"]):
        if dense_us is not None:
            packed_us = _packed_time(times, index)
            packed = packed and packed_us is not None and packed_us <= dense_us
            tiles_us = times.get("tiles", [None] * len(ROW_BUCKETS))[index]
            if tiles_us is not None and tiles_us < times["packed"][index]:
                path = "tiles"  # and past it: the tiles' cost grows slower with the rows
        chosen.append(path if packed else "dense")
    return LayerChoice(shape, num_layers, "quantized", tuple(chosen), times)


def dense_above(choice: LayerChoice) -> int:
    """The last row of the leading buckets that run packed (every row count where all do)."""
    rows = 0
    for index, kernel in enumerate(choice.kernels):
        if kernel == "dense":
            break
        rows = ROW_BUCKETS[index][1] or EVERY_ROW_COUNT
    return rows


def tiles_from(choice: LayerChoice) -> int:
    """The rows from which the packed kernel takes its tiles (0: never): where the two paths'
    costs, each a straight line through its times at the timed rows of the last bucket the dot
    products won and the first the tiles won, cross (the first bucket's lower end where the
    tiles won from the first bucket, or the bucket before was not timed)."""
    if "tiles" not in choice.kernels:
        return 0
    first = choice.kernels.index("tiles")
    if first == 0:
        return 1
    times = choice.times_us
    before = (times["packed"][first - 1], times["tiles"][first - 1])
    after = (times["packed"][first], times["tiles"][first])
    if None in before or None in after:
        return ROW_BUCKETS[first][0]
    low, high = TIMED_ROWS[first - 1], TIMED_ROWS[first]
    # packed - tiles: <= 0 at `low` (the dot products as fast or faster), > 0 at `high`
    gap_low, gap_high = before[0] - before[1], after[0] - after[1]
    crossing = low + (high - low) * gap_low / (gap_low - gap_high)
    return max(low + 1, min(high, math.ceil(crossing)))


def default_choice(
    shape: str, num_layers: int, times: dict[str, list[float | None]], default: int
) -> LayerChoice:
    """The untimed layers' choice as their kind's default ``dense_above`` makes it."""
    kernels = tuple(
        "packed" if (last or EVERY_ROW_COUNT) <= default else "dense" for _, last in ROW_BUCKETS
    )
    return LayerChoice(shape, num_layers, "quantized", kernels, times)


def plan_quantized_kernels(
    model: nn.Module, cache_folder: Path | None, clock: Callable[[], float] = time.monotonic
) -> dict[str, LayerChoice]:
    """Time (or read from the cache) the packed and dense paths of each shape of ``model``'s
    quantized layers computing in bfloat16, and set each layer's ``dense_above`` from them."""
    groups: dict[str, list[QuantizedLinear]] = {}
    for module in model.modules():
        if isinstance(module, QuantizedLinear) and module.dtype in _FAST_DTYPES:
            groups.setdefault(shape_key(module), []).append(module)
    if not groups:
        return {}
    # the smallest weights first: where the budget runs out, the largest (an embedding, the
    # head: mostly a few rows a call) keep the default
    by_size = sorted(groups.items(), key=lambda item: packed_bytes(item[1][0]))
    times = cached_or_timed(
        by_size,
        lambda layers: kernels(layers[0]),
        lambda layers, kernels, deadline, clock: time_layer(layers[0], deadline, clock),
        {**machine_key(), "layers": "quantized"},
        cache_folder,
        "the quantized layers' packed and dense paths",
        BUDGET_S,
        clock,
    )
    plan = {}
    for shape, layers in by_size:
        if times[shape]["dense"][0] is None:  # not timed (too large, or past the budget)
            plan[shape] = default_choice(shape, len(layers), times[shape], layers[0].dense_above)
            continue
        plan[shape] = choice = choose(shape, len(layers), times[shape])
        for layer in layers:
            layer.dense_above = dense_above(choice)
            layer.tiles_from = tiles_from(choice)
    return plan
