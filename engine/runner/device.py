"""Where the engine runs: ``--device`` and ``--attention-backend`` resolved for this machine, the
host-side staging of each step's inputs, and the KV cache's size on a CUDA device.
"""

from __future__ import annotations

import logging
import time

import torch

from llmrpc.kernels.triton_utils import why_triton_cannot_run

logger = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    """``--device``: auto is CUDA where a device is visible, else the CPU."""
    cuda = torch.cuda.is_available()
    if name == "cuda" and not cuda:
        raise ValueError(
            "--device cuda: no CUDA device is visible (torch "
            f"{torch.__version__} sees none); use --device cpu or auto"
        )
    if name == "cuda" or (name == "auto" and cuda):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def model_device(model: torch.nn.Module) -> torch.device:
    """The device ``model``'s weights are on."""
    return next(model.parameters()).device


def resolve_attention_backend(name: str, device: torch.device) -> str:
    """``--attention-backend``: auto is triton on CUDA (where Triton imports), torch elsewhere."""
    if name == "auto":
        return (
            "triton" if why_triton_cannot_run(device) is None and device.type == "cuda" else "torch"
        )
    if name == "triton":
        reason = why_triton_cannot_run(device)
        if reason is not None:
            raise ValueError(f"--attention-backend triton {reason}")
    return name


class HostStaging:
    """Moves a step's index lists to the device. On CUDA through persistent pinned buffers, two
    per input, used in turn and copied without blocking; before a buffer is refilled, the host
    waits for the event recorded after its last copy, which two steps later has nearly always
    passed. A step need not read anything back (one of non-final prompt chunks samples
    nothing), so nothing else orders a refill after the copy of a host ahead of its device: a
    refill before the copy ran would hand the device the next step's ``slot_mapping``. On the
    CPU the tensor is made where it is used."""

    NUM_BUFFERS = 2

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pinned = device.type == "cuda"
        self._buffers: dict[str, list[_PinnedBuffer | None]] = {}
        self._turn: dict[str, int] = {}

    def to_device(self, name: str, values, dtype: torch.dtype = torch.long) -> torch.Tensor:
        """``values`` (a list, or a host tensor of ``dtype``) as a tensor on the device."""
        host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
        if not self._pinned:
            return host
        flat = host.view(-1)
        turn = self._turn.get(name, 0)
        self._turn[name] = (turn + 1) % self.NUM_BUFFERS
        buffers = self._buffers.setdefault(name, [None] * self.NUM_BUFFERS)
        pinned = buffers[turn]
        if pinned is None or pinned.tensor.numel() < flat.numel() or pinned.tensor.dtype != dtype:
            if pinned is not None:
                pinned.copied.synchronize()  # its copy must not read freed memory
            pinned = _PinnedBuffer(max(flat.numel(), 256), dtype)
            buffers[turn] = pinned
        else:
            pinned.copied.synchronize()  # the copy that last read this buffer has run
        staged = pinned.tensor[: flat.numel()]
        staged.copy_(flat)
        on_device = staged.view(host.shape).to(self.device, non_blocking=True)
        pinned.copied.record(torch.cuda.current_stream(self.device))
        return on_device


class _PinnedBuffer:
    """A pinned host buffer and the event recorded after the copy that last read it."""

    def __init__(self, numel: int, dtype: torch.dtype) -> None:
        self.tensor = torch.empty(numel, dtype=dtype).pin_memory()
        self.copied = torch.cuda.Event()  # synchronize() on an event never recorded returns


def kv_blocks_for_device_memory(
    total_bytes: int,
    utilization: float,
    peak_bytes: int,
    other_bytes: int,
    block_bytes: int,
) -> int:
    """KV blocks that fit in ``utilization`` of a device's memory: what is left of that share
    after this process's peak during a profiled step (weights and activations: ``peak_bytes``)
    and memory outside torch's allocator (CUDA context, other processes: ``other_bytes``)."""
    budget = int(total_bytes * utilization) - peak_bytes - other_bytes
    if budget < 2 * block_bytes:
        raise ValueError(
            f"--gpu-memory-utilization {utilization}: {total_bytes * utilization / 2**30:.2f} GiB "
            f"of the device's {total_bytes / 2**30:.2f} GiB leave "
            f"{max(budget, 0) / 2**30:.2f} GiB for the KV cache after the model's "
            f"{peak_bytes / 2**30:.2f} GiB and {other_bytes / 2**30:.2f} GiB used outside it: "
            "raise it, or lower --max-num-batched-tokens"
        )
    return budget // block_bytes


class DeviceMonitor:
    """A CUDA device's memory in use (by every process on it), its total, and its utilization
    where NVML is readable (torch asks NVML through pynvml); read at most once a second, as the
    engine's figures are asked for after every step. Nothing on the CPU."""

    PERIOD_S = 1.0

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._read_at = -self.PERIOD_S
        self._figures: dict = {}

    def figures(self) -> dict:
        """``device_memory_used_bytes``, ``device_memory_total_bytes``, ``device_utilization``
        (EngineStats fields); empty on the CPU."""
        if self.device.type != "cuda":
            return {}
        now = time.monotonic()
        if now - self._read_at >= self.PERIOD_S:
            self._read_at = now
            free, total = torch.cuda.mem_get_info(self.device)
            try:
                utilization = torch.cuda.utilization(self.device) / 100
            except Exception:  # noqa: BLE001 - no NVML here: the field stays absent
                utilization = None
            self._figures = {
                "device_memory_used_bytes": total - free,
                "device_memory_total_bytes": total,
                "device_utilization": utilization,
            }
        return self._figures
