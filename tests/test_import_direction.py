"""DESIGN's import direction, read from the source: ``cli`` composes ``gateway -> clients -> protos
<- server -> engine -> kernels``; ``common`` imports none of them. Every ``import`` and
``from ... import`` in a package's modules (lazy ones inside functions too) and every module
name given to ``importlib.import_module`` is checked."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

_ABOVE_SERVER = ("llmrpc.server", "llmrpc.gateway", "llmrpc.clients", "llmrpc.cli")
# folder -> modules its code must never import (a name and everything under it)
FORBIDDEN = {
    "server": ("llmrpc.gateway", "llmrpc.clients", "llmrpc.cli"),
    "gateway": ("llmrpc.engine", "llmrpc.kernels", "llmrpc.server", "llmrpc.cli"),
    "engine": ("grpc", "llmrpc.v1", *_ABOVE_SERVER),
    "kernel_ops": ("grpc", "llmrpc.v1", "llmrpc.engine", *_ABOVE_SERVER),
    "common": ("llmrpc.engine", "llmrpc.kernels", "llmrpc.v1", *_ABOVE_SERVER),
    "clients": ("llmrpc.engine", "llmrpc.kernels", "llmrpc.server", "llmrpc.gateway", "llmrpc.cli"),
    "protos": ("llmrpc.engine", "llmrpc.kernels", *_ABOVE_SERVER, "llmrpc.common"),
    "cli": ("torch",),  # it loads in the engine (or its process), through it
    # inside the engine: the frontend's side and the scheduler import no torch; neither the
    # scheduler nor the outputs know how a step runs
    "engine/client": ("torch",),
    "engine/sched": ("torch", "llmrpc.engine.runner", "llmrpc.engine.core", "llmrpc.kernels"),
    "engine/output": ("llmrpc.engine.runner", "llmrpc.kernels"),
    "engine/spec_decode": ("torch", "llmrpc.engine.runner", "llmrpc.engine.core", "llmrpc.kernels"),
}


def imported_names(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) for every import in ``tree``."""
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append((node.lineno, node.module))
            names += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
        elif _is_import_module_call(node) and isinstance(node.args[0], ast.Constant):
            names.append((node.lineno, str(node.args[0].value)))
    return names


def _is_import_module_call(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call) or not node.args:
        return False
    function = node.func
    name = function.attr if isinstance(function, ast.Attribute) else getattr(function, "id", "")
    return name == "import_module"


def _breaks(name: str, forbidden: tuple[str, ...]) -> bool:
    return any(name == bad or name.startswith(bad + ".") for bad in forbidden)


def violations(folder: str) -> list[str]:
    found = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        if "_pb2" in path.name:
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        lines_seen = set()
        for line, name in sorted(imported_names(tree)):
            if _breaks(name, FORBIDDEN[folder]) and line not in lines_seen:
                lines_seen.add(line)
                found.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    return found


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_no_module_imports_against_the_arrow(folder):
    assert violations(folder) == []


def test_the_check_sees_lazy_and_dynamic_imports():
    source = (
        "def f():\n"
        "    from llmrpc.gateway.cli import main\n"
        "    import llmrpc.clients\n"
        "    importlib.import_module('llmrpc.gateway.app')\n"
        "from llmrpc import gateway\n"
    )
    names = {name for _, name in imported_names(ast.parse(source))}
    assert {name for name in names if _breaks(name, FORBIDDEN["server"])} == {
        "llmrpc.gateway.cli",
        "llmrpc.gateway.cli.main",
        "llmrpc.clients",
        "llmrpc.gateway.app",
        "llmrpc.gateway",
    }
