"""What the Triton kernels share: whether Triton is here, whether it interprets, and the layout
checks every wrapper runs before a launch.

On a CUDA device the kernels compile to GPU code. With ``TRITON_INTERPRET=1`` (read when a kernel
module is imported) Triton runs them on the CPU, one program at a time in numpy: the tests hold
each kernel to its torch twin that way on machines without a GPU. The interpreter mishandles
bfloat16 arithmetic and ``tl.dot`` on bfloat16 operands, so the kernels compute in float32 after
every load, and take ``DOT_F32`` (upcast before ``tl.dot``) where ``dot_in_f32`` says so.
"""

from __future__ import annotations

import functools
import os

import torch


@functools.cache
def triton_import_error() -> str | None:
    """Why ``import triton`` fails here; None where it works. Tried on first need only: a CPU
    engine on the torch backend never pays for the import (0.2-0.3 s a process)."""
    try:
        import triton  # noqa: F401  (the kernel modules import it themselves)
    except ImportError as error:  # pragma: no cover - triton is a dependency on Linux x86-64
        return str(error)
    return None


def triton_available() -> bool:
    return triton_import_error() is None


def interpreting() -> bool:
    """Whether Triton kernels run in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def why_triton_cannot_run(device: torch.device) -> str | None:
    """None where Triton kernels can run on ``device``; else why not, as the end of a sentence."""
    if not triton_available():
        return f"needs the triton package, which does not import here ({triton_import_error()})"
    if device.type == "cuda" or (device.type == "cpu" and interpreting()):
        return None
    if device.type == "cpu":
        return "runs on a CUDA device; on the CPU only with TRITON_INTERPRET=1 (slow: for tests)"
    return f"runs on a CUDA device, not {device.type}"


def dot_in_f32(dtype: torch.dtype) -> bool:
    """Whether a kernel must upcast ``dtype`` operands to float32 before ``tl.dot``: bfloat16 in
    the interpreter, whose bfloat16 dot is wrong."""
    return interpreting() and dtype == torch.bfloat16


def check(condition: bool, message: str) -> None:
    """A layout-contract check of a wrapper: ``ValueError(message)`` where it fails."""
    if not condition:
        raise ValueError(message)


def check_device(name: str, tensor: torch.Tensor, device: torch.device) -> None:
    """``tensor`` is on ``device``, which Triton can run on."""
    check(tensor.device == device, f"{name} is on {tensor.device}, expected {device}")
    reason = why_triton_cannot_run(device)
    check(reason is None, f"{name}: the Triton kernel {reason}")
