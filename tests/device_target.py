"""Where the tests marked ``gpu`` run: on a CUDA device, and in the dry run of the device check
(``LLMRPC_DEVICE_DRY_RUN=1``, set by ``DRY_RUN=1 tests/gpu/device_check.sh``) on the CPU with
small shapes and Triton interpreted, so that the check's own tests cannot rot unseen."""

from __future__ import annotations

import os

import pytest
import torch

DRY_RUN = os.environ.get("LLMRPC_DEVICE_DRY_RUN") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_DEVICE = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        DEVICE != "cuda" and not DRY_RUN, reason="needs a CUDA device (or the device dry run)"
    ),
]
