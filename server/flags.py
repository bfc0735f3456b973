"""What one ``llmrpc serve`` flag is: its names, default, value parser, state and target.

The flags themselves are the rows of ``flag_table.FLAGS``. Each is in one state:

- WORKS: honoured; ``target`` is the configuration field it sets (``"section.field"``);
- REFUSED: accepted at its default; any other value stops start-up with one line saying why;
- INERT: accepted; a warning line says it has no effect here.
"""

from __future__ import annotations

import argparse
import enum
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llmrpc.common.rest_options import RestOption, human_readable_int, json_of

__all__ = ["human_readable_int"]  # a value parser of the table, declared with the REST options


class State(enum.Enum):
    WORKS = "works"
    REFUSED = "refused"
    INERT = "inert"


@dataclass(frozen=True)
class Flag:
    names: tuple[str, ...]  # the long name first, then aliases (-tp, -O...)
    default: Any
    parse: Callable[[str], Any] | None  # None: a boolean, --flag / --no-flag
    state: State
    target: str | None = None  # "section.field" of the configuration a WORKS flag sets
    help: str = ""  # what it does (WORKS) or why it is refused or inert
    group: str = ""
    ours: bool = False  # llmrpc's own flag, not vLLM's
    choices: tuple | None = None
    nargs: str | None = None
    const: Any = None  # the value of a bare flag whose nargs is "?"
    metavar: str | None = None
    accepted: tuple = ()  # REFUSED: values besides the default that change nothing
    secret: bool = False  # never shown in the effective configuration
    repeatable: bool = False  # given again, its values are added to the first's

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def dest(self) -> str:
        return self.name.removeprefix("--").replace("-", "_")

    @property
    def is_bool(self) -> bool:
        return self.parse is None

    @property
    def is_json(self) -> bool:
        return self.parse in (json_object, compilation_config)

    def honours(self, value: Any) -> bool:
        """A REFUSED flag can still take ``value``: its default, or one that changes nothing."""
        return value == self.default or value in self.accepted


def works(names, default, parse, target: str, help: str, **more) -> Flag:
    return Flag(_names(names), default, parse, State.WORKS, target, help, **more)


def ours(names, default, parse, target: str, help: str, **more) -> Flag:
    return Flag(_names(names), default, parse, State.WORKS, target, help, ours=True, **more)


def refused(names, default, parse, why: str, target: str | None = None, **more) -> Flag:
    """``target``: where the flag will land once it works (the field may not exist yet)."""
    return Flag(_names(names), default, parse, State.REFUSED, target, why, **more)


def inert(names, default, parse, why: str, **more) -> Flag:
    return Flag(_names(names), default, parse, State.INERT, None, why, **more)


def rest_flag(declared: RestOption, section: str) -> Flag:
    """A REST gateway option (``common.rest_settings``) as a serve flag: its name, default,
    parser and help as declared; it fills ``section.field``, the gateway's settings field."""
    make = ours if declared.ours else works
    return make(
        declared.name, declared.default, declared.parse, f"{section}.{declared.field}",
        declared.help, choices=declared.choices, nargs=declared.nargs,
        metavar=declared.metavar, repeatable=declared.repeatable,
    )  # fmt: skip


def _names(names: str | tuple[str, ...]) -> tuple[str, ...]:
    return (names,) if isinstance(names, str) else names


# --- value parsers ---------------------------------------------------------------------------


def int_or_none(text: str) -> int | None:
    """A count, or ``none`` (unbounded)."""
    return None if text.strip().lower() == "none" else int(text)


def json_object(text: str) -> dict:
    """A JSON object; dotted flags (``--hf-overrides.rope_theta 1e6``) arrive as one too."""
    return json_of(dict, text, "object")


def compilation_config(text: str) -> dict:
    """A JSON object, or a bare optimisation level: ``-O3`` is ``{"level": 3}``."""
    if text.strip().isdigit():
        return {"level": int(text)}
    return json_object(text)


def json_value(text: str) -> Any:
    """A dotted flag's value: JSON if it parses (``1e6``, ``true``, ``[1, 2]``), else the text."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def deep_merge(base: dict, update: dict) -> dict:
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


class MergeJsonAction(argparse.Action):
    """A JSON flag given several times (or by several dotted keys) merges its objects."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, deep_merge(getattr(namespace, self.dest, {}) or {}, values))
