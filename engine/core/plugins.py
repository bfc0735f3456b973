"""Engine plug-ins: modules named in ``$LLMRPC_ENGINE_PLUGINS`` (comma-separated), imported
where the core runs (the engine process, or the server's process with
``--disable-frontend-multiprocessing``) before it serves. A plug-in registers utilities as it
is imported: ``register_utility(name, function)``; a client's ``call_utility(name, *args)``
then runs ``function(core, *args)`` between two steps. Kept apart from ``core.process``, which
the engine process runs as ``__main__``: a registry there would be a second copy."""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable

PLUGINS_ENV = "LLMRPC_ENGINE_PLUGINS"
_UTILITIES: dict[str, Callable] = {}


def register_utility(name: str, function: Callable) -> None:
    """A plug-in's utility ``name``: ``function(core, *args)``."""
    _UTILITIES[name] = function


def utility(name: str) -> Callable | None:
    return _UTILITIES.get(name)


def load() -> None:
    """Import the plug-ins (once per process: an imported module is not run again). One that
    fails to import stops the engine's start."""
    for name in os.environ.get(PLUGINS_ENV, "").split(","):
        if name.strip():
            importlib.import_module(name.strip())
