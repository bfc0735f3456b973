"""Multi-LoRA matmuls over a flat batch that mixes adapters and the base model: the per-step
layout (``LoRABatch``), the dispatcher, and the torch twin.

A LoRA layer adds ``(x @ A[slot].T) @ B[slot].T`` to its base output for the rows whose request
uses the adapter in ``slot``. The adapters in use sit in stacked weights, ``a_stacked [S, R, in]``
and ``b_stacked [S, out_features, R]`` (scaling folded into B); a row of slot -1 is a base-model
row and gets nothing. Two steps, as in punica/vLLM: ``lora_shrink`` to ``[T, R]``, then
``lora_expand`` adds into the layer's output in place.

``batch.backend`` picks the path: "torch" (the twin here: one gather, matmul and scatter-add per
slot in use, a handful, never a loop over requests or rows) or "triton" (``kernel_ops/
triton_lora.py``, segmented kernels, on CUDA or interpreted on the CPU). The twin computes in the
input dtype as torch matmul does (the CPU engine runs it), with no host sync.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

BACKENDS = ("torch", "triton")


@dataclass
class LoRABatch:
    """Which LoRA slot each row range of the flat batch uses (built once per step by the model
    runner)."""

    seg_starts: torch.Tensor  # [num_segments + 1] int32 on the device: rows [s_i, s_{i+1})
    seg_slots: torch.Tensor  # [num_segments] int32: slot of each range; -1 = base model
    max_seg_len: int  # longest segment with a slot (Triton grid sizing)
    # per slot in use (not -1): its rows, int64 [n], ascending, each row under one slot only
    slot_rows: list[tuple[int, torch.Tensor]]
    backend: str = "torch"  # "torch" or "triton"

    @classmethod
    def from_row_slots(cls, row_slots: list[int], device, backend="torch") -> LoRABatch | None:
        """From the slot of every row (runs of one slot merged into a segment); None when every
        row is -1 (no LoRA work at all)."""
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        starts, slots, rows_of = _segments(row_slots)
        if not rows_of:
            return None
        # two host-to-device copies in all, whatever the number of segments and slots
        segs = torch.tensor(starts + slots, dtype=torch.int32).to(device)
        flat = [row for rows in rows_of.values() for row in rows]
        flat_rows = torch.tensor(flat, dtype=torch.int64).to(device)
        slot_rows, first = [], 0
        for slot, rows in rows_of.items():
            slot_rows.append((slot, flat_rows[first : first + len(rows)]))
            first += len(rows)
        max_seg_len = max(
            end - start
            for start, end, slot in zip(starts, starts[1:], slots, strict=False)
            if slot != -1
        )
        return cls(
            seg_starts=segs[: len(starts)],
            seg_slots=segs[len(starts) :],
            max_seg_len=max_seg_len,
            slot_rows=slot_rows,
            backend=backend,
        )


def _segments(row_slots: list[int]) -> tuple[list[int], list[int], dict[int, list[int]]]:
    """(segment starts with the end appended, each segment's slot, the rows of each slot in
    use in order of first appearance). Python work per run of rows, not per row: a prefill
    chunk of thousands of rows is one run."""
    starts: list[int] = []
    slots: list[int] = []
    rows_of: dict[int, list[int]] = {}
    row = 0
    for slot, run in itertools.groupby(row_slots):
        if not isinstance(slot, int) or slot < -1:
            raise ValueError(f"row_slots[{row}] is {slot!r}: a slot must be an int >= -1")
        length = sum(1 for _ in run)
        starts.append(row)
        slots.append(slot)
        if slot != -1:
            rows_of.setdefault(slot, []).extend(range(row, row + length))
        row += length
    starts.append(row)
    return starts, slots, rows_of


def lora_shrink(x: torch.Tensor, a_stacked: torch.Tensor, batch: LoRABatch) -> torch.Tensor:
    """``[T, R]``: ``x [T, in] @ a_stacked[slot].T`` (``a_stacked [S, R, in]``); rows of slot -1
    are 0."""
    if batch.backend == "triton":
        from llmrpc.kernels import triton_lora

        return triton_lora.lora_shrink(x, a_stacked, batch)
    return lora_shrink_torch(x, a_stacked, batch)


def lora_expand(
    h: torch.Tensor,
    b_stacked: torch.Tensor,
    batch: LoRABatch,
    out: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> None:
    """In place: ``out[rows] += h[rows] @ b_stacked[slot].T`` (``b_stacked [S, out_features,
    R]``) ``+ bias[slot]`` (``bias [S, out_features]``) for rows with a slot; rows of slot -1
    untouched. ``out [T, out_features]`` may be a column slice of a wider output."""
    if batch.backend == "triton":
        from llmrpc.kernels import triton_lora

        triton_lora.lora_expand(h, b_stacked, batch, out, bias)
        return
    lora_expand_torch(h, b_stacked, batch, out, bias)


def lora_shrink_torch(x: torch.Tensor, a_stacked: torch.Tensor, batch: LoRABatch) -> torch.Tensor:
    """The twin of ``lora_shrink``: per slot in use, gather its rows, one matmul, scatter."""
    slot = _whole_batch_slot(batch, x.shape[0])
    if slot is not None:
        return x @ a_stacked[slot].T
    h = x.new_zeros(x.shape[0], a_stacked.shape[1])
    for slot, rows in batch.slot_rows:
        h.index_copy_(0, rows, x.index_select(0, rows) @ a_stacked[slot].T)
    return h


def lora_expand_torch(
    h: torch.Tensor,
    b_stacked: torch.Tensor,
    batch: LoRABatch,
    out: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> None:
    """The twin of ``lora_expand``: per slot in use, gather its rows of ``h``, one matmul (plus
    the bias, rounded in the dtype as a torch layer would), and ``index_add_`` into ``out``."""
    whole = _whole_batch_slot(batch, h.shape[0])
    if whole is not None:
        out.add_(_delta(h, b_stacked, bias, whole))
        return
    for slot, rows in batch.slot_rows:
        out.index_add_(0, rows, _delta(h.index_select(0, rows), b_stacked, bias, slot))


def _delta(h_rows, b_stacked, bias, slot) -> torch.Tensor:
    delta = h_rows @ b_stacked[slot].T
    return delta if bias is None else delta + bias[slot]


def _whole_batch_slot(batch: LoRABatch, num_tokens: int) -> int | None:
    """The slot when one slot has every row (its rows are then 0..T-1, in order: no gather or
    scatter needed); else None. Read from shapes only: no host sync."""
    if len(batch.slot_rows) == 1 and batch.slot_rows[0][1].shape[0] == num_tokens:
        return batch.slot_rows[0][0]
    return None
