"""Run `buf lint` (STANDARD, configured in the repo's buf.yaml) on the llmrpc v1 API.

    python protos/lint.py [extra buf lint arguments, e.g. --error-format json]

buf cannot reach its registry here, so the google/api and google/rpc imports come from the
installed googleapis-common-protos wheel: they are copied into .cache/buf/googleapis, the second
module of the buf.yaml workspace, which resolves imports and is excluded from lint.
Exits with buf's status (0: clean, 100: lint failures).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from generate import googleapis_include

REPO_ROOT = Path(__file__).resolve().parent.parent
DEPS_MODULE = REPO_ROOT / ".cache" / "buf" / "googleapis"
DEPS_PACKAGES = ("google/api", "google/rpc")


def assemble_deps_module() -> None:
    """Mirrors the wheel's google/api and google/rpc .proto files into DEPS_MODULE."""
    source_root = googleapis_include()
    wanted = {
        path.relative_to(source_root)
        for package in DEPS_PACKAGES
        for path in (source_root / package).rglob("*.proto")
    }
    for relative in wanted:
        source, target = source_root / relative, DEPS_MODULE / relative
        if target.is_file() and target.read_bytes() == source.read_bytes():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)
    if DEPS_MODULE.is_dir():
        for stale in DEPS_MODULE.rglob("*.proto"):
            if stale.relative_to(DEPS_MODULE) not in wanted:
                stale.unlink()


def buf_executable() -> str:
    """buf from this venv (PyPI buf-bin), else from PATH."""
    beside_python = Path(sys.executable).parent / "buf"
    if beside_python.is_file():
        return str(beside_python)
    found = shutil.which("buf")
    if found is None:
        raise RuntimeError("buf not found: pip install buf-bin")
    return found


def main(argv: list[str] | None = None) -> int:
    extra = sys.argv[1:] if argv is None else argv
    assemble_deps_module()
    return subprocess.run([buf_executable(), "lint", *extra], cwd=REPO_ROOT).returncode


if __name__ == "__main__":
    sys.exit(main())
