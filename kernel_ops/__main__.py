"""``python -m llmrpc.kernels``: build the C++ CPU kernels for this machine now (``make install``
runs it), so that no server start pays the build. Where they are built already it loads them and
says so; where they cannot be built it says why and exits 0 all the same: the engine runs the torch
operations in their place."""

import logging
import sys

from llmrpc.kernels import cpu_ops

logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
if cpu_ops.load():
    print(f"CPU kernels ready: {cpu_ops.build_directory()}", file=sys.stderr)
sys.exit(0)
