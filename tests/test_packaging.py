"""A non-editable install: the wheel built from this tree carries every package and the C++
kernels' sources (built on the user's machine), and building it warns about nothing."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_NOT_SOURCES = (".venv", ".git", "build", "*.egg-info", "__pycache__", ".*_cache", "dist")


def test_the_wheel_carries_the_kernel_sources_and_builds_without_warnings(tmp_path):
    tree = tmp_path / "tree"  # a copy: setuptools writes build/ and egg-info beside the sources
    shutil.copytree(ROOT, tree, ignore=shutil.ignore_patterns(*_NOT_SOURCES))
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "."]
        + ["-w", str(tmp_path / "wheel")],
        cwd=tree,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    assert "Warning" not in built.stdout + built.stderr, built.stdout + built.stderr
    (wheel,) = (tmp_path / "wheel").glob("llmrpc-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    kernels = ROOT / "kernels" / "csrc"
    for source in [*kernels.glob("*.cpp"), *kernels.glob("*.h")]:
        assert f"llmrpc/kernels/csrc/{source.name}" in names
    packages = {Path(name).parent for name in names if name.endswith("/__init__.py")}
    folders = ("cli", "common", "engine", "kernels", "server", "gateway", "clients")
    for folder in folders:
        for init in (ROOT / folder).rglob("__init__.py"):
            assert Path("llmrpc") / init.parent.relative_to(ROOT) in packages, init
