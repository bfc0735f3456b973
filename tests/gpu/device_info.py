"""Versions and device, as JSON (the device check's first stage): Python, torch, Triton,
Transformers, where ``llmrpc`` was imported from, and the CUDA device with its SM count."""

from __future__ import annotations

import json
import platform
import sys

import torch
import transformers
import triton

import llmrpc.engine.core.engine_core  # noqa: F401 - the engine imports with only what is here

info = {
    "python": platform.python_version(),
    "torch": torch.__version__,
    "triton": triton.__version__,
    "transformers": transformers.__version__,
    "llmrpc_from": list(__import__("llmrpc").__path__),
    "cuda": torch.cuda.is_available(),
    "device": "cpu",
}
if torch.cuda.is_available():
    props = torch.cuda.get_device_properties(0)
    info |= {
        "device": props.name,
        "sms": props.multi_processor_count,
        "memory_gib": round(props.total_memory / 2**30, 1),
        "capability": list(torch.cuda.get_device_capability(0)),
        "cuda_runtime": torch.version.cuda,
    }
json.dump(info, open(sys.argv[1], "w"), indent=2)  # noqa: SIM115 - a one-shot script
print(json.dumps(info))
