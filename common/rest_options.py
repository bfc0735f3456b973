"""What a REST gateway option is, and how one is declared: on the settings field it fills.

Each option both ``llmrpc serve`` and ``llmrpc gateway`` take (``--port``,
``--h11-max-incomplete-event-size``...) is declared once, as a field of the gateway's settings
(``common.rest_settings``) made by ``option``: its flag name, default, value parser, help text
and metavar sit on the field they fill, so the field's default is the flag's. Serve's flag table
(``server.flag_table``) and the gateway's parser (``gateway.cli``) both read the declarations
with ``declared_options`` and both show a flag's help with ``shown_help``: the two commands
cannot drift apart.

Why here, in ``common``: the server and the gateway may both import ``common`` but not each
other (cli -> gateway -> clients -> protos <- server), and ``serve --help`` must not import the
gateway (FastAPI). Declaring the options in ``gateway`` would have needed ``cli`` to hand them
to serve's flag table at run time; here both simply import them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from collections.abc import Callable
from decimal import Decimal
from typing import Any

_KEY = "llmrpc.rest_option"  # the key of a field's metadata holding its RestOption


@dataclasses.dataclass(frozen=True)
class RestOption:
    name: str  # --flag
    default: Any  # as a command line gives it: a list for a list-valued flag
    parse: Callable[[str], Any] | None  # None: an on/off switch, off by default
    help: str
    field: str = ""  # the settings field it fills (set by declared_options)
    metavar: str | None = None
    choices: tuple | None = None
    nargs: str | None = None
    repeatable: bool = False  # the flag may be given again, its values added to the first's
    ours: bool = False  # llmrpc's own flag, not vLLM's


def option(name: str, default: Any, parse: Callable[[str], Any] | None, help: str, **more):
    """A settings field declaring the flag ``name`` that fills it; the field's default is the
    flag's (a list becomes a tuple: settings are frozen)."""
    declared = RestOption(name, default, parse, help, **more)
    frozen = tuple(default) if isinstance(default, list) else default
    return dataclasses.field(default=frozen, metadata={_KEY: declared})


def declared_options(settings_class: type) -> tuple[RestOption, ...]:
    """The options declared on ``settings_class``'s fields, in field order."""
    return tuple(
        dataclasses.replace(item.metadata[_KEY], field=item.name)
        for item in dataclasses.fields(settings_class)
        if _KEY in item.metadata
    )


def shown_help(help: str, default: Any, ours: bool) -> str:
    """A working flag's help as both commands print it: ``(llmrpc)`` for our own flags, then
    what it does, then its default where it has one."""
    unset = default in (None, (), [], {}, "")
    shown = "" if unset else f" (default: {default})"
    return f"{'(llmrpc) ' if ours else ''}{help}{shown}"


# --- value parsers ---------------------------------------------------------------------------

_HUMAN_INT = re.compile(r"^(\d+(?:\.\d+)?)([kmgtKMGT]?)$")
_EXPONENTS = {"k": 1, "m": 2, "g": 3, "t": 4}


def human_readable_int(text: str) -> int:
    """``1k`` = 1000, ``1K`` = 1024, ``25.6k`` = 25600, ``2m`` = 2000000, ``2M`` = 2 * 1024**2.

    Lower-case suffixes are powers of 1000, upper-case ones powers of 1024 (as in vLLM).
    """
    match = _HUMAN_INT.match(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(
            f"invalid value {text!r}: expected an integer, optionally with a k/m/g/t (x1000) "
            "or K/M/G/T (x1024) suffix, e.g. 4096, 32k, 25.6k or 32K"
        )
    number, suffix = match.groups()
    value = Decimal(number)
    if suffix:
        base = 1000 if suffix.islower() else 1024
        value *= base ** _EXPONENTS[suffix.lower()]
    if value != value.to_integral_value():
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: not a whole number")
    return int(value)


def json_of(kind: type, text: str, what: str) -> Any:
    """``text`` as JSON that must be a ``kind`` (``what`` names it in the error)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"invalid JSON {text!r}: {error}") from None
    if not isinstance(value, kind):
        raise argparse.ArgumentTypeError(f"expected a JSON {what}, got {text!r}")
    return value


def json_list(text: str) -> list:
    """A JSON list (CORS origins, methods, headers)."""
    return json_of(list, text, "list")
