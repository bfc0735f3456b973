"""Up to how many rows a quantized layer runs its packed kernel, measured on this machine.

A packed kernel reads the quantized weights as they are, and its cost grows with every row; the
alternative, the library's, dequantizes the weight for the call and runs the dense matmul
(oneDNN; AMX tiles where the CPU has them), whose cost is mostly the dequantizing until many
rows share it. Where the two cross depends on the CPU, the kernel and the shape, so at the
first start each shape of quantized layer (in bfloat16, the one dtype whose packed kernels are
fast) is timed both ways over the buckets of rows of ``kernel_ops/linear_tuning.py``, within the
same budget and cache (``quantized-<machine>.json``), and its layers' ``dense_above`` becomes the
last bucket up to which the packed kernel never lost. Until then a layer keeps its class's
default (``layers.*_DENSE_ABOVE``). The choices are logged and reported in GetServerInfo beside
the linear kernels'.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from llmrpc.engine.quantization.layers import _FAST_DTYPES, QuantizedLinear, packed_bytes
from llmrpc.kernels.linear_tuning import (
    MAX_FLOP,
    ROW_BUCKETS,
    TIMED_BYTES,
    TIMED_ROWS,
    Family,
    LayerChoice,
    _pass_time,
    measure,
)

PACKED, DENSE = "packed", "dequantize-dense"
LAYOUT = "quantized"  # LayerChoice.layout: the weights stay packed whichever computes
ANY_ROWS = 2**31 - 1  # dense_above where the packed kernel was never beaten
SLOW_PASS_S = 0.02


def shape_key(layer: QuantizedLinear) -> str:
    blocked = " blocked" if getattr(layer, "blocked", False) else ""
    dtype = str(layer.dtype).removeprefix("torch.")
    return f"{type(layer).__name__}{blocked} {dtype} {layer.in_features}x{layer.out_features}"


def _candidates(layer: QuantizedLinear) -> list[str]:
    return [PACKED, DENSE]


def _caller(layer: QuantizedLinear, kernel: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if kernel == PACKED:
        return layer.packed_matmul
    return lambda x: F.linear(x, layer.dequantize(x.dtype))


@torch.inference_mode()
def _time(layers, kernels, deadline: float, clock=time.monotonic):
    """Microseconds per layer of each way in each bucket (as ``linear_tuning.time_shape``: up
    to 32 rows the packed weights come from memory, cycled over the shape's layers; past that
    one warm layer stands for all; a way 3x behind past 32 rows is not timed further)."""
    first = layers[0]
    count = max(1, min(len(layers), -(-TIMED_BYTES // max(1, packed_bytes(first)))))
    flop_per_row = 2 * first.in_features * first.out_features
    times: dict[str, list[float | None]] = {k: [None] * len(ROW_BUCKETS) for k in kernels}
    alive = list(kernels)
    generator = torch.Generator().manual_seed(0)
    for index, rows in enumerate(TIMED_ROWS):
        rows = max(ROW_BUCKETS[index][0], min(rows, int(MAX_FLOP // flop_per_row)))
        if rows * flop_per_row > 4 * MAX_FLOP or len(alive) < 2:
            break
        if clock() > deadline:
            return times, True
        x = torch.randn(rows, first.in_features, generator=generator).to(first.dtype)
        for kernel in alive:
            # dequantizing reads the packed weights once whatever the rows: one layer suffices
            timed = layers[:count] if rows <= 32 and kernel == PACKED else layers[:1]
            times[kernel][index] = _seconds([_caller(layer, kernel) for layer in timed], x) * 1e6
        fastest = min(times[k][index] for k in alive)
        if rows > 32:
            alive = [k for k in alive if times[k][index] <= 3 * fastest]
    return times, False


def _seconds(calls: list[Callable], x: torch.Tensor) -> float:
    """Seconds per call, as ``linear_tuning._pass_time``; but a pass of over ``SLOW_PASS_S``
    (a large layer dequantized: a third of a second for SmolLM2's head) is timed once, after
    its warm-up: its noise is small beside it, and repeats would cost start-up seconds."""
    started = time.perf_counter()
    for call in calls:
        call(x)
    if time.perf_counter() - started < SLOW_PASS_S:
        return _pass_time(calls, x)
    started = time.perf_counter()
    for call in calls:
        call(x)
    return (time.perf_counter() - started) / len(calls)


def _choose(shape: str, num_layers: int, times, tied: bool, uniform: bool) -> LayerChoice:
    """The packed kernel for every bucket up to the first the dense matmul won, dense above;
    an untimed bucket takes the last timed bucket's choice."""
    kernels, previous = [], PACKED
    for index in range(len(ROW_BUCKETS)):
        timed = {k: t[index] for k, t in times.items() if t[index] is not None}
        if previous == PACKED and timed:
            previous = PACKED if timed.get(PACKED, math.inf) <= min(timed.values()) else DENSE
        kernels.append(previous)
    return LayerChoice(shape, num_layers, LAYOUT, tuple(kernels), times)


def dense_above(choice: LayerChoice) -> int:
    """The most rows a layer of ``choice`` computes with its packed kernel."""
    last = 0
    for (_, end), kernel in zip(ROW_BUCKETS, choice.kernels, strict=True):
        if kernel != PACKED:
            return last
        last = end if end is not None else ANY_ROWS
    return last


FAMILY = Family("quantized", _candidates, _time, _choose)


def plan_quantized_kernels(model: nn.Module, cache_folder: Path | None) -> dict[str, LayerChoice]:
    """Measure (or read) each shape of ``model``'s quantized layers and set their
    ``dense_above``; the choices by shape."""
    groups: dict[str, list[QuantizedLinear]] = {}
    for module in model.modules():
        if isinstance(module, QuantizedLinear) and module.dtype in _FAST_DTYPES:
            groups.setdefault(shape_key(module), []).append(module)
    plan = measure(groups, set(), cache_folder, family=FAMILY) if groups else {}
    for shape, layers in groups.items():
        for layer in layers:
            layer.dense_above = dense_above(plan[shape])
    return plan
