"""The import direction of DESIGN.md (``gateway -> clients -> protos <- server -> engine``) for
the clients: no module under clients/ imports the engine, the server, the gateway, the kernels,
torch or Transformers, at module level or inside a function, so the client verbs start fast and
the clients install without the server's weight."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

CLIENTS = Path(__file__).resolve().parents[2] / "clients"
FORBIDDEN = ("llmrpc.engine", "llmrpc.server", "llmrpc.gateway", "llmrpc.kernels", "torch")
FORBIDDEN += ("transformers",)


def _is_forbidden(module: str) -> bool:
    return any(module == name or module.startswith(name + ".") for name in FORBIDDEN)


def imported_modules(tree: ast.AST) -> list[str]:
    """Every module an ``import`` or ``from ... import`` statement names (``from llmrpc import
    engine`` names ``llmrpc.engine``)."""
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
            names += [f"{node.module}.{alias.name}" for alias in node.names]
    return names


def named_modules(tree: ast.AST) -> set[str]:
    """String constants that are a forbidden module's dotted name (``importlib`` by name)."""
    return {
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and node.value.isascii()
        and node.value.replace(".", "").replace("_", "").isalnum()
        and _is_forbidden(node.value)
    }


def client_modules() -> list[Path]:
    return sorted(CLIENTS.rglob("*.py"))


def test_there_are_client_modules_to_check():
    relative = {str(path.relative_to(CLIENTS)) for path in client_modules()}
    assert {"client.py", "cli/chat.py", "bench/serve.py", "bench/cli.py"} <= relative


@pytest.mark.parametrize("path", client_modules(), ids=lambda p: str(p.relative_to(CLIENTS)))
def test_no_client_module_imports_a_lower_layer(path: Path):
    tree = ast.parse(path.read_text(), filename=str(path))
    wrong = sorted({name for name in imported_modules(tree) if _is_forbidden(name)})
    assert wrong == [], f"{path.relative_to(CLIENTS)} imports {', '.join(wrong)}"
    assert not named_modules(tree), f"{path.relative_to(CLIENTS)} names another layer"


def test_the_checks_see_imports_in_functions_and_from_forms():
    source = (
        "def f():\n    from llmrpc.engine.core.engine_core import EngineCore\n    import torch\n"
    )
    source += "from llmrpc import server\nimport importlib\nM = 'llmrpc.engine.config'\n"
    tree = ast.parse(source)
    assert {n for n in imported_modules(tree) if _is_forbidden(n)} == {
        "llmrpc.engine.core.engine_core",
        "llmrpc.engine.core.engine_core.EngineCore",
        "torch",
        "llmrpc.server",
    }
    assert named_modules(tree) == {"llmrpc.engine.config"}


def test_importing_every_client_module_loads_no_lower_layer():
    modules = [
        "llmrpc.clients." + str(path.relative_to(CLIENTS).with_suffix("")).replace("/", ".")
        for path in client_modules()
        if path.name != "__init__.py" and path.name != "plot.py"  # plot: optional matplotlib
    ]
    script = (
        "import importlib, sys\n"
        f"for name in {modules!r}: importlib.import_module(name)\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')"
        " or m.startswith(('llmrpc.engine', 'llmrpc.server', 'llmrpc.gateway'))))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "[]\n"
