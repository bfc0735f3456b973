"""The ``llmrpc serve`` command line, built from the flag table (``flag_table.FLAGS``).

``parse_serve_values`` turns an argument list into one value per flag: ``--config`` YAML first,
the command line over it, vLLM's defaults under both; dotted JSON flags
(``--hf-overrides.rope_theta 1e6``) merged into their object. ``check_states`` stops on a refused
flag set to a value it cannot take; ``build_configs`` fills the typed configurations from the
flags that work; ``warn_about_inert_flags`` says which flags did nothing. Bad values end the
program with one line naming the flag (exit status 2), never a traceback; an unknown flag or
``--config`` key is named with the closest known one. ``--help`` is ``serve_help``'s.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from llmrpc.common.args import closest
from llmrpc.engine.config import (
    CacheConfig,
    CompilationConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    StructuredOutputConfig,
)
from llmrpc.engine.lora.types import LoRAConfig
from llmrpc.engine.parallel.config import ParallelConfig
from llmrpc.engine.spec_decode.config import SpeculativeConfig
from llmrpc.server import serve_help
from llmrpc.server.flag_table import FLAGS
from llmrpc.server.flags import Flag, State, json_value
from llmrpc.server.settings import (
    REST_SECTIONS,
    FrontendConfig,
    LimitsConfig,
    LogConfig,
    ParsingConfig,
    TLSConfig,
)
from llmrpc.server.tracing_config import TracingConfig

FLAGS_BY_NAME: dict[str, Flag] = {name: flag for flag in FLAGS for name in flag.names}
_JSON_FLAGS = {flag.name for flag in FLAGS if flag.is_json}
# A flag's target is "section.field"; the sections are these configuration classes.
_ENGINE_PARTS = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "compilation": CompilationConfig,
    "structured_output": StructuredOutputConfig,
    "lora": LoRAConfig,
    "parallel": ParallelConfig,
    "speculative": SpeculativeConfig,
}
_FRONTEND_PARTS = {
    "tls": TLSConfig,
    "limits": LimitsConfig,
    "logs": LogConfig,
    **REST_SECTIONS,
    "parsing": ParsingConfig,
    "tracing": TracingConfig,
}
SECTIONS = {**_ENGINE_PARTS, "frontend": FrontendConfig, **_FRONTEND_PARTS}
# What a --config file's keys name: the long flags (booleans take true or false there).
_CONFIG_KEYS = [flag.name for flag in FLAGS if flag.name != "--config"]


# --- the parser ------------------------------------------------------------------------------


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.usage = "%(prog)s [MODEL] [flags]"
    # Our --help (--help=all, --help=GROUP...): the parser is made with add_help=False.
    parser.add_argument(
        "-h", "--help", action=serve_help.ServeHelpAction, help=serve_help.HELP_HELP
    )
    parser.add_argument(
        "model_tag",
        nargs="?",
        default=argparse.SUPPRESS,
        metavar="MODEL",
        help=serve_help.MODEL_HELP,
    )
    groups: dict[str, argparse._ArgumentGroup] = {}
    for flag in FLAGS:
        if flag.group not in groups:
            groups[flag.group] = parser.add_argument_group(flag.group)
        groups[flag.group].add_argument(*flag.names, **serve_help.argument_options(flag))


# --- argument lists: dotted JSON keys and --config files -------------------------------------


def expand_dotted_json(argv: list[str]) -> list[str]:
    """``--hf-overrides.rope_theta 1e6`` -> ``--hf-overrides '{"rope_theta": 1000000.0}'``."""
    expanded: list[str] = []
    tokens = iter(argv)
    for token in tokens:
        name, _, path = token.partition(".")
        if not (path and name in _JSON_FLAGS):
            expanded.append(token)
            continue
        path, has_value, value = path.partition("=")
        if not has_value:
            value = next(tokens, None)
            if value is None:
                raise ValueError(f"{token} needs a value")
        obj: Any = json_value(value)
        for key in reversed(path.split(".")):
            obj = {key: obj}
        expanded += [name, json.dumps(obj)]
    return expanded


def _config_tokens(key: str, value: Any, source: str) -> list[str]:
    name = "--" + str(key).replace("_", "-")
    flag = FLAGS_BY_NAME.get(name)
    if flag is None or name == "--config":
        match = closest(name, _CONFIG_KEYS)
        hint = f"; did you mean {match.removeprefix('--')!r}?" if match else ""
        raise ValueError(f"--config {source}: {key!r} is not a serve flag{hint}")
    if flag.is_bool:
        return [name if value else "--no-" + name[2:]]
    if value is None:
        return []
    if isinstance(value, dict):
        return [name, json.dumps(value)]
    if isinstance(value, list) and flag.nargs == "+":
        return [name, *map(str, value)]
    if isinstance(value, list):
        return [name, json.dumps(value)]
    return [name, str(value)]


def config_file_arguments(path: str) -> list[str]:
    """The flags of a ``--config`` YAML file as an argument list."""
    try:
        loaded = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as error:
        raise ValueError(f"--config {path}: cannot read it: {error}") from None
    if loaded is None:
        return []
    if not isinstance(loaded, Mapping):
        raise ValueError(f"--config {path}: expected a mapping of flag names to values")
    return [token for key, value in loaded.items() for token in _config_tokens(key, value, path)]


# --- values ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ServeValues:
    """One value per flag (``dest`` -> value), and the flags the user set (file or command line)."""

    values: dict[str, Any]
    given: frozenset[str]
    model_tag: str | None = None


def parse_serve_values(parser: argparse.ArgumentParser, argv: list[str]) -> ServeValues:
    """Parse ``serve`` arguments (without the verb); exits 2 on a bad value."""
    try:
        namespace = vars(parser.parse_args(expand_dotted_json(argv)))
        if namespace.get("config"):
            from_file = vars(parser.parse_args(config_file_arguments(namespace["config"])))
            namespace = {**from_file, **namespace}
    except ValueError as error:
        parser.error(str(error))
    model_tag = namespace.pop("model_tag", None)
    values = {flag.dest: namespace.get(flag.dest, flag.default) for flag in FLAGS}
    return ServeValues(values, frozenset(namespace), model_tag)


def _shown(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return str(value).lower()
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    return str(value)


def check_states(serve: ServeValues) -> None:
    """Raise ValueError for the first refused flag set to a value it cannot take."""
    for flag in FLAGS:
        value = serve.values[flag.dest]
        if flag.state is State.REFUSED and not flag.honours(value):
            others = "".join(f" or use {_shown(accepted)}" for accepted in flag.accepted)
            raise ValueError(
                f"{flag.name} {_shown(value)} is refused: this flag {flag.help}; leave it at "
                f"its default ({_shown(flag.default)}){others}"
            )


def warn_about_inert_flags(serve: ServeValues, logger: logging.Logger) -> None:
    """One warning line per inert flag the user set."""
    for flag in FLAGS:
        if flag.state is State.INERT and flag.dest in serve.given:
            logger.warning("%s has no effect in llmrpc: this flag %s", flag.name, flag.help)


def _model_of(serve: ServeValues) -> str | None:
    model = serve.values["model"]
    if serve.model_tag and model and serve.model_tag != model:
        raise ValueError(
            f"--model {model!r} and the positional MODEL {serve.model_tag!r} disagree; "
            "give the model once"
        )
    return serve.model_tag or model


def _frozen(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


API_KEY_ENV = "VLLM_API_KEY"  # the key --api-key stands for when not given
ADMIN_API_KEY_ENV = "LLMRPC_ADMIN_API_KEY"  # the key --admin-api-key stands for when not given


def build_configs(serve: ServeValues) -> tuple[EngineConfig, FrontendConfig]:
    """The typed configurations; raises ValueError naming a flag."""
    check_states(serve)
    fields: dict[str, dict[str, Any]] = {section: {} for section in SECTIONS}
    for flag in FLAGS:
        if flag.state is State.WORKS and flag.target is not None:
            section, name = flag.target.split(".")
            fields[section][name] = _frozen(serve.values[flag.dest])
    fields["model"]["model"] = _model_of(serve)
    if not fields["frontend"]["api_key"] and (key := os.environ.get(API_KEY_ENV)):
        fields["frontend"]["api_key"] = (key,)  # as vLLM reads it
    if not fields["frontend"]["admin_api_key"] and (key := os.environ.get(ADMIN_API_KEY_ENV)):
        fields["frontend"]["admin_api_key"] = (key,)
    fields["model"]["served_model_name"] = fields["model"]["served_model_name"] or ()
    engine = EngineConfig(**{part: cls(**fields[part]) for part, cls in _ENGINE_PARTS.items()})
    parts = {part: cls(**fields[part]) for part, cls in _FRONTEND_PARTS.items()}
    # Plugins load now, so a bad file or parser name stops start-up before anything is bound.
    from llmrpc.server.output_parsing import OutputParsers  # gRPC: once the flags are parsed

    OutputParsers.from_config(parts["parsing"])
    return engine, FrontendConfig(**fields["frontend"], **parts)


def configs_or_exit(
    parser: argparse.ArgumentParser, serve: ServeValues
) -> tuple[EngineConfig, FrontendConfig]:
    """``build_configs``, or exit with status 2 and one line naming the flag."""
    try:
        return build_configs(serve)
    except ValueError as error:
        parser.error(str(error))


# --- the effective configuration GetServerInfo publishes -------------------------------------


def config_sections(engine_config: EngineConfig, frontend: FrontendConfig) -> dict[str, Any]:
    """Section name -> the configuration object a flag's target names."""
    sections = {part: getattr(engine_config, part) for part in _ENGINE_PARTS}
    sections.update({part: getattr(frontend, part) for part in _FRONTEND_PARTS})
    return {**sections, "frontend": frontend}


def effective_config(engine_config: EngineConfig, frontend: FrontendConfig) -> dict[str, str]:
    """Flag name (as in --config files) -> value, for every flag that works; secrets left out."""
    sections = config_sections(engine_config, frontend)
    config = {}
    for flag in FLAGS:
        if flag.state is State.WORKS and flag.target is not None and not flag.secret:
            section, name = flag.target.split(".")
            config[flag.dest] = _shown_config(getattr(sections[section], name))
    return config


def _shown_config(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return str(value)
