"""A Triton kernel compiled for an NVIDIA GPU without one: its PTX, for tests of what the GPU
will run that the interpreter cannot show (how ``/`` or ``exp`` is lowered). Triton's wheel
carries the compiler (LLVM and ptxas); the compile runs in a process of its own, since the test
process imports the kernels under ``TRITON_INTERPRET=1``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

# sm_90: the H100/H200 the GPU check runs on
_SCRIPT = """
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

module, name, signature, constexprs, options = json.loads(sys.argv[1])
kernel = getattr(importlib.import_module(module), name)
source = ASTSource(kernel, signature, constexprs=constexprs)
compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
sys.stdout.write(compiled.asm["ptx"])
"""


def compiled_ptx(
    module: str, name: str, signature: dict, constexprs: dict, cache_dir: Path, **options
) -> str:
    """The PTX of kernel ``name`` of ``module`` for sm_90, with arguments of ``signature``
    (Triton's type names, "constexpr" for those in ``constexprs``) and launch ``options``."""
    env = {**os.environ, "TRITON_CACHE_DIR": str(cache_dir)}
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT, json.dumps([module, name, signature, constexprs, options])],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout
