"""The command lines' parser: a usage error is one line (no usage dump) and exit status 2, as
argparse's, and an unknown flag is named with the closest known one. Every ``llmrpc`` verb
parses with it."""

from __future__ import annotations

import argparse
import difflib
from typing import NoReturn

# How alike a mistyped flag and a known one must be (difflib's ratio) for a suggestion.
SUGGESTION_CUTOFF = 0.8


class OneLineErrorParser(argparse.ArgumentParser):
    """Reports a bad value in one line (no usage dump) and exits with status 2, like argparse;
    an unknown flag is named with the closest known one."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        namespace, unknown = self.parse_known_args(args, namespace)
        if unknown:
            self.error(unrecognized(unknown, option_strings(self)))
        return namespace


def option_strings(parser: argparse.ArgumentParser) -> list[str]:
    """Every flag ``parser`` and its subcommands know (a subcommand's unknown flags come back
    to the top parser)."""
    names = []
    for action in parser._actions:
        names += action.option_strings
        if isinstance(action, argparse._SubParsersAction):
            for subparser in dict.fromkeys(action.choices.values()):
                names += option_strings(subparser)
    return list(dict.fromkeys(names))


def closest(name: str, known: list[str]) -> str | None:
    """The known name ``name`` most likely misspells, if one is close."""
    matches = difflib.get_close_matches(name, known, n=1, cutoff=SUGGESTION_CUTOFF)
    return matches[0] if matches else None


def unrecognized(tokens: list[str], known: list[str]) -> str:
    """``unrecognized argument --max-model-lenn; did you mean --max-model-len?``"""
    flags = [token.partition("=")[0] for token in tokens if token.startswith("-")]
    # The words after an unknown flag are its value, unknown only because it is: name the flags.
    described = [(flag, closest(flag, known)) for flag in flags] or [(t, None) for t in tokens]
    if len(described) == 1:
        name, match = described[0]
        return f"unrecognized argument {name}" + (f"; did you mean {match}?" if match else "")
    listed = ", ".join(
        name + (f" (did you mean {match}?)" if match else "") for name, match in described
    )
    return f"unrecognized arguments: {listed}"
