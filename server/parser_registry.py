"""What the tool-call and reasoning parsers share: a registry of parser classes by name (the
``--tool-call-parser`` / ``--reasoning-parser`` value), with plugin files that add to it, and the
two helpers their streams use to hold back text that is not decided yet."""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar

logger = logging.getLogger(__name__)

_P = TypeVar("_P", bound=type)


class ParserRegistry(Generic[_P]):
    """Concrete subclasses of ``base`` by name; ``kind`` names them in messages ("tool parser"),
    ``flag`` is the option that picks one and ``plugin_flag`` the one that loads a plugin."""

    def __init__(self, base: type, kind: str, flag: str, plugin_flag: str) -> None:
        self.base, self.kind, self.flag, self.plugin_flag = base, kind, flag, plugin_flag
        self.parsers: dict[str, _P] = {}

    def register(self, name: str) -> Callable[[_P], _P]:
        """Class decorator: make a subclass of ``base`` available as ``name``. A later
        registration of a name replaces the earlier one (a plugin may override a built-in)."""
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"a {self.kind} name must be a non-empty string, not {name!r}")

        def register(cls: _P) -> _P:
            if not (isinstance(cls, type) and issubclass(cls, self.base)) or inspect.isabstract(
                cls
            ):
                raise TypeError(
                    f"{self.kind} {name!r}: {cls!r} is not a concrete {self.base.__name__} subclass"
                )
            if self.parsers.get(name, cls) is not cls:
                logger.info(
                    "%s %r: %s replaces %s", self.kind, name, cls.__name__, self.parsers[name]
                )
            self.parsers[name] = cls
            return cls

        return register

    def get(self, name: str):
        """A new parser registered as ``name``; ValueError naming the known ones if none is."""
        if name not in self.parsers:
            known = ", ".join(self.names())
            raise ValueError(f"{self.flag}: unknown {self.kind} {name!r} (known: {known})")
        return self.parsers[name]()

    def names(self) -> list[str]:
        return sorted(self.parsers)

    def load_plugin(self, path: str | os.PathLike[str]) -> list[str]:
        """Import the Python file at ``path``, which registers parsers here; returns the names it
        registered. ValueError naming the plugin flag if it is not a Python file or its import
        fails (the registry is then as it was)."""
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"{self.plugin_flag}: {path} is not a file")
        digest = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:16]
        module_name = f"llmrpc_{self.plugin_flag.strip('-').replace('-', '_')}_{digest}"
        spec = importlib.util.spec_from_file_location(module_name, path)
        if spec is None or spec.loader is None:
            raise ValueError(f"{self.plugin_flag}: {path} is not a Python file")
        before = dict(self.parsers)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            sys.modules.pop(module_name, None)
            self.parsers.clear()
            self.parsers.update(before)
            raise ValueError(f"{self.plugin_flag}: importing {path} failed: {exc!r}") from exc
        return sorted(name for name, cls in self.parsers.items() if before.get(name) is not cls)


def held_from(text: str, pos: int, marker: str) -> int:
    """Where the longest end of ``text[pos:]`` that could begin ``marker`` starts (or the end)."""
    for start in range(max(pos, len(text) - len(marker) + 1), len(text)):
        if marker.startswith(text[start:]):
            return start
    return len(text)


class LeadingSpace:
    """Holds whitespace at the start of a part until more follows: a part that is only
    whitespace is None in a whole parse, so a stream never sends it."""

    def __init__(self) -> None:
        self._held = ""
        self._open = False

    def release(self, text: str) -> str:
        if self._open:
            return text
        self._held += text
        if not self._held.strip():
            return ""
        self._open = True
        text, self._held = self._held, ""
        return text
