"""The engine's C++ CPU kernels (``kernel_ops/csrc``), built for this machine once.

``torch.utils.cpp_extension`` compiles them with the system C++ compiler against the installed
torch, for the widest vector unit torch itself dispatches to here (AVX-512, AVX2, or plain C++),
and caches the library under torch's extension folder (``TORCH_EXTENSIONS_DIR``). ``make install``
builds them (``python -m llmrpc.kernels``); otherwise the first start pays the build, about
``BUILD_CPU_SECONDS`` of compiler time, and logs a line before and after it.

The build folder is shared by every checkout and environment on the machine, so it is keyed by
content: its name carries a hash of the sources, the headers, the compile flags and torch's
version, and the sources are compiled from copies inside it. A second checkout of the same sources
loads the library the first one built (without running ninja: the name says everything the build
depends on); an edited kernel, other flags or another torch get a folder of their own, and no
checkout's build ever points at another's files.

Where the build fails (no compiler, no Python headers), the engine logs why once and runs the
torch operations of ``kernel_ops/attention.py`` and ``kernel_ops/elementwise.py``, which the
kernels are tested against.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
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
    _CSRC / "decode_layer.cpp",
    _CSRC / "elementwise.cpp",
    _CSRC / "int4_linear.cpp",
    _CSRC / "linear.cpp",  # packed_linear, for torch.compile (engine/runner/compilation.py)
    _CSRC / "prefill_attention.cpp",
]
_HEADERS = [
    _CSRC / "amx_bf16.h",
    _CSRC / "avx2_bf16.h",
    _CSRC / "kernel_threads.h",
    _CSRC / "rotary.h",
    _CSRC / "vec_utils.h",
]
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

# Compiler time of a build, all sources: 48 s user + 8 s system (43 s wall on 2 cores) measured
# on an Intel Xeon (family 6 model 167, AVX512-BF16, AMX; 2 cores, KVM), 2026-12-03
BUILD_CPU_SECONDS = 55
STALE_LOCK_AGE_S = 600.0  # longer than a build takes even on a busy 2-core machine
PROGRESS_EVERY_S = 30.0  # a "still building" line while the compiler runs
BUILT_MARKER = "llmrpc-build.json"  # written once a build has loaded: the folder is complete

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
    """Load the kernels, building them first (once per machine and source); False where they
    cannot be."""
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


def set_kernel_threads(count: int) -> None:
    """Run our kernels (linear layers, attention, norms, activations) on ``count`` threads whatever
    torch's count is (0: torch's); see ``csrc/kernel_threads.h``. Needs the kernels loaded."""
    torch.ops.llmrpc_cpu.set_kernel_threads(count)


def compile_flags() -> list[str]:
    """The compiler flags for this machine's vector unit."""
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
        if torch.cpu._is_amx_tile_supported():
            flags += ["-mamx-tile", "-mamx-bf16", "-mamx-int8"]  # bf16_linear's tile kernel
    return flags


def build_name(files: list[Path], flags: list[str]) -> str:
    """The build's name: a hash of what the library depends on, never of where the files are."""
    digest = hashlib.sha256(" ".join(flags).encode())
    digest.update(f"torch {torch.__version__} {torch.version.git_version}".encode())
    for file in files:
        digest.update(f"\0{file.name}\0".encode())
        digest.update(file.read_bytes())
    return f"llmrpc_cpu_{_capability().lower()}_{digest.hexdigest()[:12]}"


def build_directory() -> Path:
    """The folder of this machine's build of these sources (made if missing)."""
    from torch.utils.cpp_extension import _get_build_directory

    name = build_name(_SOURCES + _HEADERS, compile_flags())
    return Path(_get_build_directory(name, verbose=False))


def _build() -> Path:
    """Load the build of these sources, building it first where none is complete."""
    flags = compile_flags()
    directory = build_directory()
    name = directory.name
    library = directory / f"{name}.so"
    _clear_stale_lock(name)
    if (directory / BUILT_MARKER).exists() and library.exists():
        torch.ops.load_library(str(library))
    else:
        _compile(name, directory, flags)  # and loads it
    return library


def _compile(name: str, directory: Path, flags: list[str]) -> None:
    from torch.utils.cpp_extension import load as load_extension

    _put_ninja_on_path()
    sources = _stage_sources(directory)
    cores = len(os.sched_getaffinity(0))
    logger.info(
        "building the C++ CPU kernels (%s) in %s, once for these sources: about %d "
        "CPU-seconds of compiling, roughly %d s on %d idle cores (longer on a busy machine)",
        _capability(),
        directory,
        BUILD_CPU_SECONDS,
        BUILD_CPU_SECONDS / min(cores, len(_SOURCES)),
        cores,
    )
    started = time.monotonic()
    with _progress_lines(started):
        load_extension(
            name=name,
            sources=[str(source) for source in sources],
            extra_cflags=flags,
            extra_ldflags=["-fopenmp"],
            build_directory=str(directory),
            is_python_module=False,
            verbose=False,
        )
    record = {"flags": flags, "torch": torch.__version__, "sources": [s.name for s in sources]}
    (directory / BUILT_MARKER).write_text(json.dumps(record, indent=1) + "\n")
    logger.info("CPU kernels built in %.0f s (%s)", time.monotonic() - started, directory)


def _stage_sources(directory: Path) -> list[Path]:
    """Copies of the sources and headers in the build folder (``src/``), which the build
    compiles: build.ninja then names the same files whichever checkout builds, and a checkout
    deleted later takes nothing of the build with it. A copy already there is this content (the
    folder's name is its hash) and is left untouched, so ninja sees nothing new."""
    staged = directory / "src"
    staged.mkdir(parents=True, exist_ok=True)
    for file in _SOURCES + _HEADERS:
        copy = staged / file.name
        if not copy.exists():
            partial = staged / f".{file.name}.{os.getpid()}"
            shutil.copyfile(file, partial)
            os.replace(partial, copy)  # another process staging at once writes the same bytes
    return [staged / file.name for file in _SOURCES]


@contextlib.contextmanager
def _progress_lines(started: float):
    """A line every ``PROGRESS_EVERY_S`` while the compiler runs, so a slow build on a busy
    machine is not a silent start."""
    done = threading.Event()

    def report() -> None:
        while not done.wait(PROGRESS_EVERY_S):
            logger.info("still building the CPU kernels (%.0f s)", time.monotonic() - started)

    reporter = threading.Thread(target=report, name="kernel-build-progress", daemon=True)
    reporter.start()
    try:
        yield
    finally:
        done.set()
        reporter.join()


def _clear_stale_lock(name: str) -> None:
    """torch takes a lock file in the build folder for every load and waits, without end, while
    another holds it: a process killed while building (SIGKILL, out of memory) leaves it behind,
    and every later start would hang. A build takes a minute or two; a lock older than
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
