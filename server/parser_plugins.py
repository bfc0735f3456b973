"""Loading a parser plugin: a Python file, imported by path, that registers parsers in a
registry (``--tool-parser-plugin``, ``--reasoning-parser-plugin``)."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from pathlib import Path


def load_plugin(path: str | os.PathLike[str], registry: dict, flag: str) -> list[str]:
    """Import the Python file at ``path``, which registers parsers in ``registry``; returns the
    names it registered. ValueError naming ``flag`` if it is not a Python file or its import
    fails (the registry is then as it was)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{flag}: {path} is not a file")
    digest = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:16]
    module_name = f"llmrpc_{flag.strip('-').replace('-', '_')}_{digest}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"{flag}: {path} is not a Python file")
    before = dict(registry)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(module_name, None)
        registry.clear()
        registry.update(before)
        raise ValueError(f"{flag}: importing {path} failed: {exc!r}") from exc
    return sorted(name for name, cls in registry.items() if before.get(name) is not cls)
