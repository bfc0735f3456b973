"""Where and when the C++ CPU kernels are built (``kernel_ops/cpu_ops.py``).

The build folder lives under torch's extension folder, shared by every checkout and environment on
the machine: its name is keyed by the sources' content and the compile flags, and the sources are
compiled from copies inside it, so a second checkout of the same sources loads the build the first
one made. Builds here are of a two-file stand-in (a function and a header, no torch headers), which
compiles in about a second, in a ``TORCH_EXTENSIONS_DIR`` of the test's own.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

from llmrpc.kernels import cpu_ops

KERNEL_FILES = [path.name for path in cpu_ops._SOURCES + cpu_ops._HEADERS]


def _copy_csrc(destination: Path) -> Path:
    destination.mkdir(parents=True)
    for name in KERNEL_FILES:
        shutil.copy(cpu_ops._CSRC / name, destination / name)
    return destination


def _files(csrc: Path) -> list[Path]:
    return [csrc / name for name in KERNEL_FILES]


def test_the_build_name_follows_the_sources_not_the_checkout(tmp_path):
    first = _copy_csrc(tmp_path / "checkout-a" / "kernel_ops" / "csrc")
    second = _copy_csrc(tmp_path / "elsewhere" / "b" / "csrc")
    flags = cpu_ops.compile_flags()
    name = cpu_ops.build_name(_files(first), flags)
    assert name == cpu_ops.build_name(_files(second), flags)
    assert name == cpu_ops.build_name(cpu_ops._SOURCES + cpu_ops._HEADERS, flags)
    assert name.startswith(f"llmrpc_cpu_{cpu_ops._capability().lower()}_")

    edited = second / "vec_utils.h"  # a header counts as much as a source
    edited.write_text(edited.read_text() + "\n// edited\n")
    assert cpu_ops.build_name(_files(second), flags) != name
    assert cpu_ops.build_name(_files(first), [*flags, "-DEXTRA"]) != name


def _stand_in(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "stand_in.h").write_text("inline int stand_in_value() { return 7; }\n")
    (folder / "stand_in.cpp").write_text(
        '#include "stand_in.h"\nextern "C" int llmrpc_stand_in() { return stand_in_value(); }\n'
    )
    return folder


_BUILD_SCRIPT = textwrap.dedent(
    """
    import logging, sys
    from pathlib import Path
    from llmrpc.kernels import cpu_ops

    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
    folder = Path(sys.argv[1])
    cpu_ops._SOURCES = [folder / "stand_in.cpp"]
    cpu_ops._HEADERS = [folder / "stand_in.h"]
    print("library:", cpu_ops._build())
    """
)


def _build_in_a_process(folder: Path, extensions: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(extensions)}
    done = subprocess.run(
        [sys.executable, "-c", _BUILD_SCRIPT, str(folder)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done


def test_a_second_checkout_of_the_same_sources_reuses_the_build(tmp_path):
    """Each start is a process of its own (torch remembers a build only within a process)."""
    extensions = tmp_path / "torch_extensions"
    first = _build_in_a_process(_stand_in(tmp_path / "a" / "csrc"), extensions)
    (build,) = [path for path in extensions.iterdir() if path.is_dir()]
    library = build / f"{build.name}.so"
    built = library.stat()
    assert "building the C++ CPU kernels" in first.stdout

    second = _build_in_a_process(_stand_in(tmp_path / "b" / "csrc"), extensions)
    assert library.stat().st_mtime_ns == built.st_mtime_ns, "the second checkout rebuilt"
    assert "building" not in second.stdout, second.stdout
    assert [path for path in extensions.iterdir() if path.is_dir()] == [build]
    # the build compiles its own copies: deleting either checkout leaves it whole
    assert str(tmp_path / "a") not in (build / "build.ninja").read_text()
    shutil.rmtree(tmp_path / "a")
    _build_in_a_process(tmp_path / "b" / "csrc", extensions)
    assert library.stat().st_mtime_ns == built.st_mtime_ns


def test_a_first_build_says_what_it_builds_where_and_how_long(tmp_path, monkeypatch, caplog):
    folder = _stand_in(tmp_path / "csrc")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "torch_extensions"))
    monkeypatch.setattr(cpu_ops, "_SOURCES", [folder / "stand_in.cpp"])
    monkeypatch.setattr(cpu_ops, "_HEADERS", [folder / "stand_in.h"])
    with caplog.at_level(logging.INFO, logger="llmrpc.kernels.cpu_ops"):
        cpu_ops._build()
    before, after = [record.getMessage() for record in caplog.records]
    name = cpu_ops.build_name(cpu_ops._SOURCES + cpu_ops._HEADERS, cpu_ops.compile_flags())
    assert "building the C++ CPU kernels" in before
    assert str(tmp_path / "torch_extensions" / name) in before
    assert "CPU-seconds" in before  # roughly how long
    assert after.startswith("CPU kernels built in ")

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="llmrpc.kernels.cpu_ops"):
        cpu_ops._build()  # built: loaded without a word
    assert caplog.records == []
