"""A non-editable install: the wheel built from this tree carries every package and the C++
kernels' sources (built on the user's machine), and building it warns about nothing."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from importlib.metadata import packages_distributions
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
_NOT_SOURCES = (
    ".venv", ".venv-*", ".device-carry", "device-check", ".git", "build", "*.egg-info",
    "__pycache__", ".*_cache", "dist",
)  # fmt: skip


def _package_dirs() -> dict[str, str]:
    """pyproject.toml's package-dir: ``llmrpc.engine`` -> ``engine``."""
    with (ROOT / "pyproject.toml").open("rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]["package-dir"]


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
    kernels = ROOT / _package_dirs()["llmrpc.kernels"] / "csrc"
    for source in [*kernels.glob("*.cpp"), *kernels.glob("*.h")]:
        assert f"llmrpc/kernels/csrc/{source.name}" in names
    packages = {Path(name).parent for name in names if name.endswith("/__init__.py")}
    for package, folder in _package_dirs().items():
        for init in (ROOT / folder).rglob("__init__.py"):
            inside = init.parent.relative_to(ROOT / folder)
            assert Path(*package.split("."), inside) in packages, init


def test_no_folder_of_the_checkout_hides_an_installed_package():
    """Where the checkout's root is on ``sys.path`` (``python -m llmrpc.cli`` run in it, and
    Ray's workers, which take the driver's folder), a top-level folder of the checkout with an
    ``__init__.py`` is found before site-packages under its own name: a folder called
    ``kernels`` hid Hugging Face's ``kernels``, which Transformers imports, and every model load
    failed (``cannot import name 'CUDAProperties' from 'kernels'``)."""
    installed = packages_distributions()
    hiding = [
        folder.name
        for folder in ROOT.iterdir()
        if (folder / "__init__.py").is_file() and folder.name in installed
    ]
    assert hiding == [], {name: installed[name] for name in hiding}
