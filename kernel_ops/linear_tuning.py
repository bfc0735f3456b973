"""Which kernel computes each floating-point linear layer on the CPU: chosen by timing every
candidate on this machine, per layer shape and per bucket of rows a call takes.

The candidates (those the layer and the CPU allow):
- ``blocked-avx512bf16``: our blocked layout, AVX512-BF16 dot products (``csrc/bf16_linear.cpp``);
- ``blocked-amx``: the same layout and weights, AMX tiles (the same file);
- ``blocked-gemv``: the same layout and weights, one row per call only (the same file), timed in
  the first bucket alone;
- ``blocked-avx2``: the same layout and weights, AVX2 fused multiply-adds in float32 (the same
  file), where the CPU lacks AVX512-BF16 (where it has it, the dot products do the same work in
  half the instructions);
- ``blocked-avx2-f32``: its form for many rows, the same sums bit for bit: a block's weights
  converted to float32 a segment of inputs at a time (8 KB, kept in the L1 cache) for tiles of 6
  rows, where the AVX2 kernel converts each weight in registers for tiles of 4 (SmolLM2's 120 body
  layers, AMD EPYC family 26 with the AVX2 build: 0.85-0.89 of its time at 8 to 512 rows, 1.2-1.5x
  at 2 rows), beside it where the CPU lacks AVX512-BF16;
- ``blocked-gemv-avx2``: its one-row form, reading one block at a time as ``blocked-gemv`` does (the
  same file), timed in the first bucket alone, beside ``blocked-gemv`` too where both are built
  (SmolLM2's 120 body layers at one row, AMD EPYC family 26: 7.1-7.4 against 7.5-7.9 ms on one
  thread, the AVX512-BF16 one faster; another CPU may differ);
- ``onednn``: oneDNN's packed layout and its matmul (AMX where the CPU has it; ``PackedLinear``).

Not a candidate: the plain weight with ``torch.nn.functional.linear``, which reorders the weight on
every call (behind the best candidate at every row count up to 512, on every shape timed on an Intel
Xeon with AMX) and in float32 goes to a GEMM whose sums depend on the rows of the call, so seeded
outputs would change with the batch.

Each is timed over the model's own layers of that shape, in order as a step reads them (up to
``TIMED_BYTES`` of weights, so that small layers come from memory as in a step, not from a warm
cache; past 32 rows, where a call is compute-bound, on one layer), at ``TIMED_ROWS`` rows for each
bucket of ``ROW_BUCKETS``. A layer keeps one layout (its
weights are held once): the layout whose best kernels lose least against the best of all over the
buckets (the sum of log time ratios); inside the blocked layout each call then takes the kernel
timed fastest for its bucket (``BlockedLinear.kernel_by_bucket``). A tied embedding's layer stays in
the blocked layout wherever it fits, which serves the embedding's rows from the same weights: any
other layout would hold that weight twice. The blocked kernels do not sum bit for bit alike (AMX
adds a pair's two products its own way; the one-row kernel sums in four chains), so under
``--batch-invariant`` a layer takes one kernel's sums for every bucket (the AVX2 kernel and its
float32-segment form sum alike, so such a layer may take either per bucket), never the one-row
kernel.

Measurements are cached in a JSON file per machine (CPU model and flags, thread count, the kernels'
build, torch's version and oneDNN's instruction-set cap), under the model cache folder: a later
start on the same machine reads them, and times only shapes it has not seen (or whose timing the
budget cut short). The whole measurement is bounded by ``BUDGET_S`` (buckets left untimed take
the last timed bucket's choice, and the log says so). A shape with one candidate (float32:
oneDNN's) is not timed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from llmrpc.kernels import cpu_ops
from llmrpc.kernels.linear import (
    BlockedLinear,
    Layout,
    PackedLinear,
    can_pack,
    packable,
    shape_key,
    tied_embeddings,
)

logger = logging.getLogger(__name__)

# (first, last) rows of each bucket a call's row count falls in; None: no upper end. The C++
# kernel indexes kernel_by_bucket by the same bounds (kRowBucketEnds).
ROW_BUCKETS: tuple[tuple[int, int | None], ...] = (
    (1, 1), (2, 8), (9, 32), (33, 128), (129, 1024), (1025, None),
)  # fmt: skip
TIMED_ROWS = (1, 8, 32, 128, 512, 2048)  # the rows each bucket is timed at
TIMED_BYTES = 32 * 2**20  # weights each timed pass reads, cycling the shape's layers
SLICE_BYTES = 64 * 2**20  # a larger layer is timed on its first outputs (time scales with them)
MAX_FLOP = 4e9  # per timed call: larger buckets are timed at fewer rows (never under the first)
REPEATS = 3  # timed passes per candidate and bucket (the fastest counts), after one warm-up
BUDGET_S = 8.0
KERNELS = (
    "blocked-avx512bf16", "blocked-amx", "blocked-gemv", "blocked-avx2", "blocked-gemv-avx2",
    "blocked-avx2-f32", "onednn",
)  # fmt: skip
LAYOUT = {
    "blocked-avx512bf16": "blocked",
    "blocked-amx": "blocked",
    "blocked-gemv": "blocked",
    "blocked-avx2": "blocked",
    "blocked-gemv-avx2": "blocked",
    "blocked-avx2-f32": "blocked",
    "onednn": "onednn",
}
# csrc/bf16_linear.cpp's ids
BLOCKED_KERNEL_IDS = {
    "blocked-avx512bf16": 0, "blocked-amx": 1, "blocked-gemv": 2, "blocked-avx2": 3,
    "blocked-gemv-avx2": 4, "blocked-avx2-f32": 5,
}  # fmt: skip
# the kernels that serve the first bucket (one row) only, and the kernel of their instruction set
# that serves the buckets past it where none was timed and no other candidate was
ONE_ROW_KERNELS = {"blocked-gemv": "blocked-avx512bf16", "blocked-gemv-avx2": "blocked-avx2"}
# kernels whose every output is another kernel's, bit for bit (test_bf16_linear.py checks it): a
# batch-invariant layer may take either in any bucket
SAME_SUMS = {"blocked-avx2-f32": "blocked-avx2"}


def row_bucket(rows: int) -> int:
    """The index in ``ROW_BUCKETS`` of a call of ``rows`` rows."""
    for index, (_, last) in enumerate(ROW_BUCKETS):
        if last is None or rows <= last:
            return index
    raise AssertionError("the last bucket has no end")


def bucket_name(index: int) -> str:
    first, last = ROW_BUCKETS[index]
    return str(first) if first == last else f"{first}-{last}" if last else f"{first}+"


def candidates(linear: nn.Linear) -> list[str]:
    """The kernels that can compute ``linear`` here."""
    names = []
    blocked = BlockedLinear.fits(linear)
    dot_products = blocked and torch.ops.llmrpc_cpu.bf16_linear_supported()
    if dot_products:
        names.append("blocked-avx512bf16")
        if linear.in_features % 32 == 0 and torch.ops.llmrpc_cpu.bf16_amx_supported():
            names.append("blocked-amx")
        names.append("blocked-gemv")
    if blocked and torch.ops.llmrpc_cpu.bf16_fma_supported():
        # at one row both one-row kernels read at memory speed (which is faster varies), past it
        # the dot products take half the AVX2 kernel's instructions
        names += (
            ["blocked-gemv-avx2"]
            if dot_products
            else ["blocked-avx2", "blocked-avx2-f32", "blocked-gemv-avx2"]
        )
    if can_pack(linear.weight.dtype, linear.weight.device):
        names.append("onednn")
    return names


@dataclass(frozen=True)
class LayerChoice:
    """What a shape's layers run: one layout, a kernel per bucket, and the times behind it."""

    shape: str
    num_layers: int
    layout: str  # blocked or onednn
    kernels: tuple[str, ...]  # per bucket of ROW_BUCKETS
    times_us: dict[str, list[float | None]]  # kernel -> per bucket (None: not timed)

    @property
    def op(self) -> str:
        return f"linear {self.shape}"

    def describe(self) -> str:
        if len(self.times_us) < 2:
            return f"{self.shape} ({self.num_layers} layers): {self.kernels[0]}, the one candidate"
        parts = []
        for index, kernel in enumerate(self.kernels):
            spent = self.times_us.get(kernel, [None] * len(ROW_BUCKETS))[index]
            shown = f" {spent:.0f} us" if spent is not None else " (untimed)"
            parts.append(f"{bucket_name(index)} rows {kernel}{shown}")
        return f"{self.shape} ({self.num_layers} layers, {self.layout} layout): " + ", ".join(parts)


def choose(
    shape: str, num_layers: int, times: dict[str, list[float | None]], tied: bool, uniform: bool
) -> LayerChoice:
    """The layout and per-bucket kernels that ``times`` (microseconds per layer) favour."""
    timed = [i for i in range(len(ROW_BUCKETS)) if any(t[i] is not None for t in times.values())]
    best = {i: min(t[i] for t in times.values() if t[i] is not None) for i in timed}
    by_layout: dict[str, list[str]] = {}
    for kernel in times:
        by_layout.setdefault(LAYOUT[kernel], []).append(kernel)

    def loss(kernels: Iterable[str], index: int) -> float:
        spent = [times[k][index] for k in kernels if times[k][index] is not None]
        # none timed here: dropped earlier as 3x slower than the best (time_shape)
        return math.log(min(spent) / best[index]) if spent else math.log(3)

    if (tied or uniform) and "blocked" in by_layout:  # one weight; or one reduction order
        layout = "blocked"
    else:
        layout = min(by_layout, key=lambda name: sum(loss(by_layout[name], i) for i in timed))
    members = by_layout[layout]
    if uniform:  # one kernel's sums for every row count (so none that serves one row only)
        families: dict[str, list[str]] = {}
        for name in members:
            if name not in ONE_ROW_KERNELS:
                families.setdefault(SAME_SUMS.get(name, name), []).append(name)
        members = min(families.values(), key=lambda names: sum(loss(names, i) for i in timed))
    kernels, previous = [], members[0]
    for index in range(len(ROW_BUCKETS)):
        allowed = [k for k in members if index == 0 or k not in ONE_ROW_KERNELS]
        if index in timed and any(times[k][index] is not None for k in allowed):
            previous = min(
                (k for k in allowed if times[k][index] is not None), key=lambda k: times[k][index]
            )
        elif index and previous in ONE_ROW_KERNELS:  # past one row, none timed
            # the first candidate for many rows (the dot products where built); else the one-row
            # kernel's own instruction set's (an AVX512-BF16 machine does not time the AVX2 kernel)
            previous = next(
                (k for k in members if k not in ONE_ROW_KERNELS), ONE_ROW_KERNELS[previous]
            )
        kernels.append(previous)  # an untimed bucket keeps the last timed bucket's choice
    return LayerChoice(shape, num_layers, layout, tuple(kernels), times)


# --- timing ----------------------------------------------------------------------------------


def _module(linear: nn.Linear, kernel: str) -> nn.Module:
    if LAYOUT[kernel] == "blocked":
        module = BlockedLinear(linear)
        module.kernel_by_bucket = [BLOCKED_KERNEL_IDS[kernel]] * len(ROW_BUCKETS)
        if kernel in ONE_ROW_KERNELS:  # timed at one row only; the rest never reach it
            sibling = BLOCKED_KERNEL_IDS[ONE_ROW_KERNELS[kernel]]
            module.kernel_by_bucket[1:] = [sibling] * (len(ROW_BUCKETS) - 1)
        return module
    return PackedLinear(linear)


def _timed_slices(layers: list[nn.Linear]) -> list[nn.Linear]:
    """The layers a pass reads: the first outputs of a layer past SLICE_BYTES, as many layers
    (cycling) as make TIMED_BYTES."""
    first = layers[0]
    row_bytes = first.in_features * first.weight.element_size()
    out = min(first.out_features, max(64, SLICE_BYTES // row_bytes // 64 * 64))
    count = max(1, min(len(layers), -(-TIMED_BYTES // (out * row_bytes))))
    return [_slice(layer, out) for layer in layers[:count]]


def _slice(linear: nn.Linear, out: int) -> nn.Linear:
    """The layer's first ``out`` outputs, its weights viewed (packing copies them)."""
    if out == linear.out_features:
        return linear
    part = nn.Linear(linear.in_features, out, bias=linear.bias is not None, device="meta")
    part.weight = nn.Parameter(linear.weight.detach()[:out], requires_grad=False)
    if linear.bias is not None:
        part.bias = nn.Parameter(linear.bias.detach()[:out], requires_grad=False)
    return part


def call_time(
    call: Callable[[], object],
    repeats: int = REPEATS,
    best_us: float = math.inf,
    min_seconds: float = 0.0,
) -> float:
    """Microseconds of the fastest of ``repeats`` calls, after one warm-up, and of more while the
    timed calls have taken under ``min_seconds`` in all (a short call's fastest of many is less
    at the mercy of a busy moment; at most 64). Once they have, a path over twice ``best_us``
    (another candidate's) is not timed again."""
    fastest, spent, timed = math.inf, 0.0, 0
    call()  # the warm-up
    while timed < repeats or (spent < min_seconds and timed < 64):
        started = time.perf_counter()
        call()
        took = time.perf_counter() - started
        fastest, spent, timed = min(fastest, took), spent + took, timed + 1
        if fastest * 1e6 > 2 * best_us and spent >= min_seconds:
            break
    return fastest * 1e6


def _pass_time(modules: list[nn.Module], x: torch.Tensor) -> float:
    """Seconds per layer of the fastest of REPEATS passes over ``modules`` (after a warm-up)."""

    def one_pass() -> None:
        for module in modules:
            module(x)

    return call_time(one_pass) * 1e-6 / len(modules)


@torch.inference_mode()
def time_shape(
    layers: list[nn.Linear],
    kernels: list[str],
    deadline: float,
    clock: Callable[[], float] = time.monotonic,
) -> tuple[dict[str, list[float | None]], bool]:
    """Microseconds per layer of each kernel in each bucket, None where the bucket was not timed
    (past ``deadline``, or its rows past MAX_FLOP even at the bucket's first row count); and
    whether the deadline left any bucket untimed."""
    sliced = _timed_slices(layers)
    packed = {kernel: [_module(layer, kernel) for layer in sliced] for kernel in kernels}
    first = sliced[0]
    flop_per_row = 2 * first.in_features * first.out_features
    times: dict[str, list[float | None]] = {k: [None] * len(ROW_BUCKETS) for k in kernels}
    alive = list(kernels)
    generator = torch.Generator().manual_seed(0)
    for index, rows in enumerate(TIMED_ROWS):
        low = ROW_BUCKETS[index][0]
        rows = max(low, min(rows, int(MAX_FLOP // flop_per_row)))
        if rows * flop_per_row > 4 * MAX_FLOP:
            break
        if clock() > deadline:
            return times, True
        x = torch.randn(rows, first.in_features, generator=generator).to(first.weight.dtype)
        # up to 32 rows a call reads its weights from memory, as a step does; past that it is
        # compute-bound, and one layer (warm) stands for all
        if index == 1:  # past one row
            alive = [k for k in alive if k not in ONE_ROW_KERNELS]
        if not alive:
            break
        for kernel in alive:
            modules = packed[kernel] if rows <= 32 else packed[kernel][:1]
            times[kernel][index] = _pass_time(modules, x) * 1e6
        fastest = min(times[k][index] for k in alive)
        if rows > 32:  # compute-bound from here: a kernel 3x behind does not catch up
            alive = [k for k in alive if times[k][index] <= 3 * fastest]
    return times, False


# --- the cache -------------------------------------------------------------------------------


def machine_key() -> dict[str, str]:
    """What the measurements depend on: the CPU, the thread count, the kernels' build, torch, and
    the instruction sets oneDNN is allowed (its candidate is another kernel under a cap: without
    AMX, say)."""
    model, flags = "", ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not model:
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    model = model or platform.processor()
    # load(), not loaded(): the engine plans before anything else has loaded the kernels
    build = cpu_ops.build_directory().name if cpu_ops.load() else "no C++ kernels"
    return {
        "cpu": model,
        "cpu_flags": hashlib.sha256(flags.encode()).hexdigest()[:16],
        "threads": str(torch.get_num_threads()),
        "build": build,
        "torch": torch.__version__,
        "onednn_isa": os.environ.get("ONEDNN_MAX_CPU_ISA", os.environ.get("DNNL_MAX_CPU_ISA", "")),
    }


def cache_file(folder: Path, key: dict[str, str]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return folder / f"linear-{digest}.json"


def read_cache(path: Path, key: dict[str, str]) -> dict:
    try:
        data = json.loads(path.read_text())
        return data["shapes"] if data.get("key") == key else {}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def write_cache(path: Path, key: dict[str, str], shapes: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.partial")
        partial.write_text(json.dumps({"key": key, "shapes": shapes}, indent=1))
        os.replace(partial, path)
    except OSError as error:  # a read-only cache: measured again at the next start
        logger.warning("could not save the kernel measurements in %s: %s", path, error)


# --- the plan for a model ------------------------------------------------------------------


def cached_or_timed(
    groups: Iterable[tuple[str, list]],
    kernels_of: Callable[[list], list[str]],
    time_one: Callable[..., tuple[dict[str, list[float | None]], bool]],
    key: dict[str, str],
    cache_folder: Path | None,
    what: str,
    budget_s: float = BUDGET_S,
    clock: Callable[[], float] = time.monotonic,
) -> dict[str, dict[str, list[float | None]]]:
    """Each shape's times (kernel -> per bucket, None: not timed), in ``groups``' order (shape
    key, its layers): read from the cache file for ``key``, else timed now by ``time_one(layers,
    kernels, deadline, clock)`` within ``budget_s`` (a shape the budget cut short is timed again
    at the next start; one with a single candidate is not timed). ``what`` names the shapes in
    the log line."""
    path = cache_file(cache_folder, key) if cache_folder is not None else None
    known = read_cache(path, key) if path is not None else {}
    started = clock()
    deadline = started + budget_s
    result, timed, cut, changed = {}, 0, False, False
    for shape, layers in groups:
        kernels = kernels_of(layers)
        times = known.get(shape)
        if len(kernels) == 1:  # nothing to choose between
            times = {kernels[0]: [None] * len(ROW_BUCKETS)}
        elif times is None or set(times) != set(kernels):
            times, short = time_one(layers, kernels, deadline, clock)
            if not short:
                known[shape] = times
                changed = True
            cut |= short
            timed += any(t is not None for row in times.values() for t in row)
        result[shape] = times
    if timed:
        logger.info(
            "timed %s for %d layer shape%s in %.1f s%s",
            what, timed, "" if timed == 1 else "s", clock() - started,
            f" (the rest past the {budget_s:.0f} s budget take the last timed choice)" if cut
            else "",
        )  # fmt: skip
    if (timed or changed) and path is not None:
        write_cache(path, key, known)
    return result


def measure(
    groups: dict[str, list[nn.Linear]],
    tied: set[str],
    cache_folder: Path | None,
    uniform: bool = False,
    clock: Callable[[], float] = time.monotonic,
) -> dict[str, LayerChoice]:
    """A choice for each shape in ``groups`` (shape key -> its layers, in model order): read
    from the cache, else timed now (and cached once every bucket was timed)."""
    times = cached_or_timed(
        groups.items(),
        lambda layers: candidates(layers[0]),
        lambda layers, kernels, deadline, clock: time_shape(layers, kernels, deadline, clock),
        machine_key(),
        cache_folder,
        "the linear kernels",
        clock=clock,
    )
    return {
        shape: choose(shape, len(groups[shape]), shape_times, shape in tied, uniform)
        for shape, shape_times in times.items()
    }


def plan_linear_kernels(
    model: nn.Module, cache_folder: Path | None, uniform: bool = False
) -> dict[str, LayerChoice]:
    """The choice for each shape of ``model``'s packable linear layers (call before packing)."""
    groups: dict[str, list[nn.Linear]] = {}
    tied = set()
    embeddings = tied_embeddings(model)
    for module in model.modules():
        if not packable(module):
            continue
        groups.setdefault(shape_key(module), []).append(module)
        if id(module.weight) in embeddings:
            tied.add(shape_key(module))
    return measure(groups, tied, cache_folder, uniform)


def layouts(plan: dict[str, LayerChoice]) -> dict[str, Layout]:
    """What ``pack_linear_layers`` takes: each shape's layout and blocked kernel ids by bucket."""
    return {
        shape: (choice.layout, [BLOCKED_KERNEL_IDS.get(k, 0) for k in choice.kernels])
        for shape, choice in plan.items()
    }
