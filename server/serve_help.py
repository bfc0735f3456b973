"""``llmrpc serve --help``: the flags that work, by group, then the refused and inert ones in brief.

``--help=all`` shows every flag in full; ``--help=GROUP`` one group (by its key, its heading, or
vLLM's name for it, e.g. ``ModelConfig``); ``--help=listgroup`` the groups; ``--help=WORD`` the
flag named WORD, else the flags whose names contain WORD. The parser that parses never prints:
each help is a parser of its own, built from the chosen rows of the flag table.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import textwrap
from typing import Any

from llmrpc.common.rest_options import shown_help
from llmrpc.server.flag_table import FLAGS
from llmrpc.server.flags import Flag, MergeJsonAction, State
from llmrpc.server.models_help import models_help

# Group heading -> the names --help=GROUP takes for it: our key first, then vLLM's.
GROUP_TOPICS: dict[str, tuple[str, ...]] = {
    "model": ("model", "ModelConfig"),
    "frontend": ("frontend", "Frontend"),
    "llmrpc (our own flags)": ("llmrpc",),
    "loading": ("loading", "LoadConfig"),
    "structured output and reasoning": (
        "structured-output",
        "DecodingConfig",
        "StructuredOutputsConfig",
    ),
    "parallelism": ("parallelism", "ParallelConfig"),
    "KV cache": ("kv-cache", "CacheConfig"),
    "scheduler": ("scheduler", "SchedulerConfig"),
    "LoRA": ("lora", "LoRAConfig"),
    "multimodal": ("multimodal", "MultiModalConfig"),
    "observability": ("observability", "ObservabilityConfig"),
    "other": ("other", "VllmConfig"),
}
HELP_HELP = (
    "Show the flags that work, by group, and list refused and inert flags in brief. "
    "--help=all: every flag in full; --help=GROUP: one group (--help=listgroup lists them); "
    "--help=models: the architectures served natively, through Transformers, or refused; "
    "--help=WORD: the flag named WORD, else the flags whose names contain WORD."
)
MODEL_HELP = "Model to serve, the same as --model."
_TAGS_EXPLAINED = (
    "Flags take vLLM's names, defaults and syntax. A flag marked [refused] stops start-up with "
    "one line if set to a value it cannot take; one marked [inert] is accepted and has no effect "
    "(a warning says so); every other flag works. (llmrpc) marks our own flags."
)
_MORE = (
    "--help=all shows every flag in full; --help=GROUP one group (--help=listgroup lists them); "
    "--help=models the architectures served natively, through Transformers, or refused; "
    "--help=WORD the flag named WORD, else the flags whose names contain WORD."
)


# --- one flag as argparse shows it -----------------------------------------------------------


def _shown(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) or value is None else str(value)


def refusal_terms(flag: Flag) -> str:
    """When a REFUSED flag stops start-up: "if it is turned on", "... anything but 1 or uni"."""
    if flag.is_bool:
        return "if it is turned off" if flag.default else "if it is turned on"
    takes = [value for value in (flag.default, *flag.accepted) if value is not None]
    if not takes:
        return "if it is set"
    return f"if it is set to anything but {' or '.join(map(_shown, takes))}"


def flag_help(flag: Flag) -> str:
    if flag.state is State.REFUSED:
        return f"[refused] This flag {flag.help}; start-up stops {refusal_terms(flag)}."
    if flag.state is State.INERT:
        return f"[inert] No effect: this flag {flag.help}."
    return shown_help(flag.help, flag.default, flag.ours)  # as llmrpc gateway shows REST flags


def argument_options(flag: Flag) -> dict[str, Any]:
    """``add_argument`` keywords of a flag (its value is absent unless given: "set by the user")."""
    options: dict[str, Any] = {
        "dest": flag.dest,
        "default": argparse.SUPPRESS,
        "help": flag_help(flag),
    }
    if flag.is_bool:
        options["action"] = argparse.BooleanOptionalAction
        return options
    options["type"] = flag.parse
    if flag.is_json:
        options["action"] = MergeJsonAction
    if flag.repeatable:
        options["action"] = "extend"
    for key in ("choices", "nargs", "const", "metavar"):
        if getattr(flag, key) is not None:
            options[key] = getattr(flag, key)
    return options


# --- which flags a --help shows --------------------------------------------------------------


def _normal(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def _group_named(topic: str) -> str | None:
    wanted = _normal(topic)
    for heading, names in GROUP_TOPICS.items():
        if wanted in {_normal(heading), *map(_normal, names)}:
            return heading
    return None


def chosen_flags(topic: str) -> list[Flag] | None:
    """The flags ``--help=TOPIC`` shows in full; None when nothing matches."""
    if topic.lower() == "all":
        return list(FLAGS)
    group = _group_named(topic)
    if group is not None:
        return [flag for flag in FLAGS if flag.group == group]
    word = topic.lower().lstrip("-")
    named = [flag for flag in FLAGS if word in (name.lstrip("-") for name in flag.names)]
    found = named or [flag for flag in FLAGS if any(word in name for name in flag.names)]
    return found or None


# --- printing --------------------------------------------------------------------------------


def _width() -> int:
    return max(shutil.get_terminal_size().columns - 2, 40)


def _help_parser(parser: argparse.ArgumentParser, flags: list[Flag], epilog: str):
    """A parser that only prints: ``parser``'s usage and description, ``flags`` by group."""
    shown = argparse.ArgumentParser(
        prog=parser.prog,
        usage=parser.usage,
        description=parser.description,
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,  # the epilog keeps its lines
        add_help=False,
    )
    shown.add_argument("-h", "--help", nargs="?", metavar="TOPIC", help=HELP_HELP)
    shown.add_argument("model_tag", nargs="?", metavar="MODEL", help=MODEL_HELP)
    groups: dict[str, argparse._ArgumentGroup] = {}
    for flag in flags:
        if flag.group not in groups:
            groups[flag.group] = shown.add_argument_group(flag.group)
        groups[flag.group].add_argument(*flag.names, **argument_options(flag))
    return shown


def _wrapped(text: str, indent: str = "", more: str = "") -> str:
    """``text`` filled to the terminal, never breaking a flag name at its hyphens."""
    return textwrap.fill(
        text,
        _width(),
        initial_indent=indent,
        subsequent_indent=more or indent,
        break_on_hyphens=False,
        break_long_words=False,
    )


def _brief_name(flag: Flag) -> str:
    """``--tensor-parallel-size/-tp``, ``--runner (generate accepted)``."""
    name = "/".join(flag.names)
    accepted = ", ".join(map(_shown, flag.accepted))
    return f"{name} ({accepted} accepted)" if accepted else name


def _in_brief(state: State, heading: str) -> list[str]:
    """One entry per reason: the flags that share it, then the reason."""
    by_reason: dict[str, list[str]] = {}
    for flag in FLAGS:
        if flag.state is state:
            by_reason.setdefault(flag.help, []).append(_brief_name(flag))
    lines = [_wrapped(heading)]
    for reason, names in by_reason.items():
        lines.append(_wrapped(f"{', '.join(names)}: {reason}.", "  ", "      "))
    return lines


def brief_epilog() -> str:
    """The end of the plain --help: refused and inert flags by reason, then where to read more."""
    refused = _in_brief(
        State.REFUSED,
        "Refused flags: start-up stops with one line if one is set to a value it cannot take "
        "(its default, and the values named after it, are fine):",
    )
    inert = _in_brief(State.INERT, "Inert flags: accepted; a warning says each has no effect:")
    closing = [
        _wrapped(f"Flags take vLLM's names, defaults and syntax; (llmrpc) marks our own. {_MORE}")
    ]
    return "\n".join([*refused, "", *inert, "", *closing])


def serve_help(parser: argparse.ArgumentParser, topic: str | None) -> str:
    """The text ``--help`` (topic None) or ``--help=TOPIC`` prints; ValueError for no match."""
    if topic is None:
        working = [flag for flag in FLAGS if flag.state is State.WORKS]
        return _help_parser(parser, working, brief_epilog()).format_help()
    if topic.lower() == "listgroup":
        return _group_list()
    if topic.lower() == "models":
        return models_help(_width())
    flags = chosen_flags(topic)
    if flags is None:
        raise ValueError(
            f"--help={topic}: no group or flag name matches; --help=listgroup lists the groups"
        )
    return _help_parser(parser, flags, _wrapped(_TAGS_EXPLAINED)).format_help()


def _group_list() -> str:
    lines = ["Groups of flags; --help=GROUP shows one, by our name or vLLM's:"]
    for heading, (key, *vllm_names) in GROUP_TOPICS.items():
        count = sum(flag.group == heading for flag in FLAGS)
        also = f"; vLLM: {', '.join(vllm_names)}" if vllm_names else ""
        lines.append(f"  {key:18} {heading} ({count} flags{also})")
    return "\n".join(lines) + "\n"


class ServeHelpAction(argparse.Action):
    """``-h``/``--help`` with an optional topic, as vLLM's: ``--help=all``, ``--help=GROUP``..."""

    def __init__(
        self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None
    ):
        super().__init__(
            option_strings, dest, nargs="?", default=default, metavar="TOPIC", help=help
        )

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        try:
            text = serve_help(parser, values)
        except ValueError as error:
            parser.error(str(error))
        sys.stdout.write(text)
        parser.exit()
