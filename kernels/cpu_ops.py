"""The engine's C++ CPU kernels (``kernels/csrc``), built for this machine on first use.

``torch.utils.cpp_extension`` compiles them with the system C++ compiler against the installed
torch, for the widest vector unit torch itself dispatches to here (AVX-512, AVX2, or plain C++),
and caches the library under torch's extension folder (``TORCH_EXTENSIONS_DIR``), so only the first
start on a machine pays the build (about 10 s on 2 cores). The name of the build carries a hash of
the sources and flags: an edited kernel or another machine's vector unit gets a build of its own.

Where the build fails (no compiler, no Python headers), the engine logs why once and runs the
torch operations of ``kernels/attention.py`` and ``kernels/elementwise.py``, which the kernels are
tested against.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import threading
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [
    _CSRC / "bf16_linear.cpp",
    _CSRC / "decode_attention.cpp",
    _CSRC / "elementwise.cpp",
    _CSRC / "int4_linear.cpp",
    _CSRC / "linear.cpp",  # packed_linear, for torch.compile (engine/compilation.py)
]
_HEADERS = [_CSRC / "vec_utils.h"]
# torch's CPU capability -> the flags and macros that select ATen's matching Vectorized<float>
_CAPABILITY_FLAGS = {
    "AVX512": [
        "-mavx512f",
        "-mavx512bw",
        "-mavx512vl",
        "-mavx512dq",
        "-mfma",
        "-DCPU_CAPABILITY=AVX512",
        "-DCPU_CAPABILITY_AVX512",
    ],
    "AVX2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"],
}

STALE_LOCK_AGE_S = 600.0  # a build takes about 10 s on 2 cores

_lock = threading.Lock()
_state: dict[str, object] = {}  # "loaded": bool, "error": str


def vector_width() -> int:
    """Float lanes of the vector unit the kernels are built for (head sizes must be multiples)."""
    return 16 if _capability() == "AVX512" else 8


def loaded() -> bool:
    """Whether ``load()`` has loaded the kernels (it never builds them)."""
    return bool(_state.get("loaded"))


@functools.cache
def _capability() -> str:
    capability = torch.backends.cpu.get_cpu_capability()
    return capability if capability in _CAPABILITY_FLAGS else "DEFAULT"


def load() -> bool:
    """Build (once per machine and source) and load the kernels; False where they cannot be."""
    with _lock:
        if "loaded" in _state:
            return bool(_state["loaded"])
        try:
            _build()
            _state["loaded"] = True
            logger.info("CPU kernels loaded (%s)", _capability())
        except Exception as error:  # the compiler's own message says what is missing
            _state["loaded"] = False
            _state["error"] = _first_error(str(error))
            logger.warning(
                "CPU kernels could not be built, the engine runs torch operations in their place "
                "(slower): %s",
                _state["error"] or type(error).__name__,
            )
        return bool(_state["loaded"])


def _build() -> None:
    from torch.utils.cpp_extension import load as load_extension

    _put_ninja_on_path()
    # -fopenmp: at::parallel_for is an OpenMP pragma, dropped without it. The extension then needs
    # libgomp.so.1, which resolves to the one torch ships and has loaded, so the kernels share
    # torch's thread team and its set_num_threads.
    flags = ["-O3", "-fopenmp", *_CAPABILITY_FLAGS.get(_capability(), [])]
    if (
        _capability() == "AVX512"
        and torch.cpu._is_avx512_bf16_supported()
        and torch.cpu._is_vnni_supported()
    ):
        flags += ["-mavx512bf16", "-mavx512vnni"]  # the int4 kernel's conversions, dot products
    digest = hashlib.sha256(" ".join(flags).encode())
    for source in _SOURCES + _HEADERS:
        digest.update(source.read_bytes())
    name = f"llmrpc_cpu_{_capability().lower()}_{digest.hexdigest()[:12]}"
    _clear_stale_lock(name)
    load_extension(
        name=name,
        sources=[str(source) for source in _SOURCES],
        extra_cflags=flags,
        extra_ldflags=["-fopenmp"],
        is_python_module=False,
        verbose=False,
    )


def _clear_stale_lock(name: str) -> None:
    """torch takes a lock file in the build folder for every load and waits, without end, while
    another holds it: a process killed while building (SIGKILL, out of memory) leaves it behind,
    and every later start would hang. A build takes seconds; a lock older than
    ``STALE_LOCK_AGE_S`` is such a leftover and is removed."""
    from torch.utils.cpp_extension import _get_build_directory

    lock = Path(_get_build_directory(name, verbose=False)) / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_AGE_S:
        logger.warning("removing %s, left %.0f s ago by a build that did not finish", lock, age)
        lock.unlink(missing_ok=True)


def _put_ninja_on_path() -> None:
    """torch builds with ``ninja`` from PATH; the one the ``ninja`` package installed is in the
    environment's bin folder, which is not on PATH when a venv's ``llmrpc`` is run directly."""
    if shutil.which("ninja"):
        return
    import ninja

    os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])


def _first_error(message: str) -> str:
    """The compiler's first error line (the exception ends with ninja's summary)."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    compiler = [line for line in lines if "error:" in line]
    errors = compiler or [line for line in lines if "error" in line.lower()]
    return (errors or lines or [""])[0][:300]
