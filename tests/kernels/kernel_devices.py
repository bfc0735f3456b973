"""Where the kernel tests run: the CPU under Triton's interpreter, and a CUDA device natively
(marked ``gpu``), each skipped where it cannot run."""

from __future__ import annotations

import pytest
import torch

from llmrpc.kernels.triton_utils import interpreting

DEVICES = [
    pytest.param(
        "cpu", marks=pytest.mark.skipif(not interpreting(), reason="needs TRITON_INTERPRET=1")
    ),
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
        ],
    ),
]
