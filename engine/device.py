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
    """Moves a step's index lists to the device. On CUDA through persistent pinned buffers, one
    per input, grown as needed and copied without blocking: the previous step's copies have
    finished by the time a buffer is refilled, since every step ends by reading its sampled ids
    back. On the CPU the tensor is made where it is used."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pinned = device.type == "cuda"
        self._buffers: dict[str, torch.Tensor] = {}

    def to_device(self, name: str, values, dtype: torch.dtype = torch.long) -> torch.Tensor:
        """``values`` (a list, or a host tensor of ``dtype``) as a tensor on the device."""
        host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
        if not self._pinned:
            return host
        flat = host.view(-1)
        buffer = self._buffers.get(name)
        if buffer is None or buffer.numel() < flat.numel() or buffer.dtype != dtype:
            buffer = torch.empty(max(flat.numel(), 256), dtype=dtype).pin_memory()
            self._buffers[name] = buffer
        staged = buffer[: flat.numel()]
        staged.copy_(flat)
        return staged.view(host.shape).to(self.device, non_blocking=True)


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
