"""Make ``llmrpc`` importable from a checkout without installing it: a folder holding ``llmrpc/``
whose subpackages are links to the checkout's folders, as ``pyproject.toml``'s package-dir maps
them (``llmrpc.engine`` -> ``engine/``). Prints the folder to put on ``PYTHONPATH``.

``python tests/gpu/link_checkout.py TARGET`` (TARGET is emptied and made again).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]


def link_checkout(target: Path, root: Path = ROOT) -> Path:
    with (root / "pyproject.toml").open("rb") as f:
        package_dir: dict[str, str] = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    shutil.rmtree(target, ignore_errors=True)
    namespace = target / "llmrpc"
    namespace.mkdir(parents=True)  # a namespace package, as installed: no __init__.py
    for name, folder in package_dir.items():
        parts = name.split(".")
        if parts[0] != "llmrpc" or len(parts) != 2:
            raise ValueError(f"pyproject.toml package-dir: {name} is not llmrpc.<name>")
        (namespace / parts[1]).symlink_to(root / folder, target_is_directory=True)
    return target


if __name__ == "__main__":
    print(link_checkout(Path(sys.argv[1]).resolve()))
