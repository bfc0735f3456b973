"""The REST options are declared once (``common.rest_settings``) and both commands take them from
there: every flag of ``llmrpc gateway`` is a flag of ``llmrpc serve`` with the same default,
the REST ones with the same help too, and a value given to either command reaches the gateway's
settings alike. Read from the two parsers as they are built, nothing changed."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from llmrpc import cli
from llmrpc.cli.rest import gateway_settings
from llmrpc.common.rest_options import declared_options, human_readable_int, json_list
from llmrpc.common.rest_settings import ApiSettings, CorsSettings, HttpSettings
from llmrpc.gateway import cli as gateway_cli
from llmrpc.server import options

SERVE = cli.build_parser()[1]
GATEWAY = gateway_cli.build_parser()
DECLARED = {
    declared.name: (section, declared)
    for section in ("http", "cors", "api")
    for declared in declared_options(
        {"http": HttpSettings, "cors": CorsSettings, "api": ApiSettings}[section]
    )
}
# Gateway flags serve has with a meaning of its own, shared by its gRPC server (the address,
# TLS, keys, chat template, tracing, fan-out bounds, logging): same name and default, each
# command's help. --backend* reach the replicas, which serve is.
SHARED_WITH_GRPC = {
    "--host", "--ssl-keyfile", "--ssl-certfile", "--ssl-ca-certs", "--ssl-cert-reqs",
    "--enable-ssl-refresh", "--api-key", "--chat-template", "--otlp-traces-endpoint",
    "--max-prompts-per-request", "--max-sequences-per-request", "--log-level",
}  # fmt: skip


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {name: action for action in parser._actions for name in action.option_strings}


def _gateway_flags() -> dict[str, argparse.Action]:
    actions = _actions(GATEWAY)
    return {
        name: action
        for name, action in actions.items()
        if name.startswith("--") and name != "--help" and not name.startswith("--backend")
    }


def _same(value):
    return tuple(value) if isinstance(value, list) else value


def test_every_gateway_flag_is_a_serve_flag_with_the_same_default():
    serve_actions = _actions(SERVE)
    serve_defaults = options.parse_serve_values(SERVE, []).values
    gateway_defaults = vars(GATEWAY.parse_args(["--backend", "x:1"]))
    flags = _gateway_flags()
    assert set(flags) == set(DECLARED) | SHARED_WITH_GRPC
    for name, action in flags.items():
        assert name in serve_actions, name
        serve_default = serve_defaults[options.FLAGS_BY_NAME[name].dest]
        assert _same(gateway_defaults[action.dest]) == _same(serve_default), name


def test_the_rest_flags_have_one_help_default_and_parser_on_both_commands():
    serve_actions = _actions(SERVE)
    for name, action in _gateway_flags().items():
        if name not in DECLARED:
            continue
        served = serve_actions[name]
        assert action.help == served.help, name
        assert (action.type, action.choices, action.nargs, action.metavar) == (
            served.type, served.choices, served.nargs, served.metavar
        ), name  # fmt: skip
        flag = options.FLAGS_BY_NAME[name]
        section, declared = DECLARED[name]
        assert action.default == flag.default == declared.default, name
        assert flag.target == f"rest_{section}.{declared.field}", name


def test_a_settings_field_default_is_its_flag_default():
    """The default the gateway's settings take when built in code is the flags' default."""
    for _, (section, declared) in DECLARED.items():
        settings = {"http": HttpSettings, "cors": CorsSettings, "api": ApiSettings}[section]()
        assert getattr(settings, declared.field) == _same(declared.default), declared.name


def test_the_rest_defaults_are_written_once_in_the_product():
    root = Path(__file__).parents[2]
    sources = [
        path.read_text()
        for folder in ("cli", "common", "server", "gateway")
        for path in (root / folder).rglob("*.py")
    ]
    assert sum(len(re.findall(r"\b4194304\b", text)) for text in sources) == 1


def _other_value(declared) -> list[str]:
    """A command line setting ``declared`` to a value other than its default."""
    if declared.parse is None:
        return [declared.name]
    if declared.choices:
        return [declared.name, next(c for c in declared.choices if c != declared.default)]
    if declared.parse is json_list:
        return [declared.name, '["https://a.example"]']
    if declared.nargs == "+":
        return [declared.name, "a.b", "c.d"]
    if declared.parse in (int, float, human_readable_int):
        return [declared.name, "4097"]
    return [declared.name, "/somewhere"]


@pytest.mark.parametrize("name", sorted(DECLARED))
def test_a_rest_flag_reaches_the_gateway_settings_alike_from_both_commands(name):
    section, declared = DECLARED[name]
    argv = _other_value(declared)
    _, frontend = options.build_configs(options.parse_serve_values(SERVE, argv))
    from_serve = getattr(gateway_settings(frontend), section)
    args = GATEWAY.parse_args(["--backend", "x:1", *argv])
    from_gateway = getattr(gateway_cli.settings_from_args(args), section)
    value = getattr(from_gateway, declared.field)
    assert value != _same(declared.default)
    assert getattr(from_serve, declared.field) == value


def test_a_repeated_middleware_flag_adds_to_the_first_on_both_commands():
    argv = ["--middleware", "a.b", "--middleware", "c.d", "e.f"]
    _, frontend = options.build_configs(options.parse_serve_values(SERVE, argv))
    args = GATEWAY.parse_args(["--backend", "x:1", *argv])
    expected = ("a.b", "c.d", "e.f")
    assert frontend.rest_api.middleware == expected
    assert gateway_cli.settings_from_args(args).api.middleware == expected


@pytest.mark.parametrize("command", ["serve", "gateway"])
def test_a_cors_flag_takes_a_json_list_only(command, capsys):
    """serve took any value here (a JSON string became CORS rules of its characters)."""
    argv = ["--allowed-origins", '"https://a.example"']
    with pytest.raises(SystemExit) as exit_info:
        if command == "serve":
            options.parse_serve_values(SERVE, argv)
        else:
            GATEWAY.parse_args(["--backend", "x:1", *argv])
    assert exit_info.value.code == 2
    assert "--allowed-origins: expected a JSON list" in capsys.readouterr().err
