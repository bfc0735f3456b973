"""The structured-output flags reach the engine's configuration and each request's spec."""

from __future__ import annotations

import pytest

from llmrpc.common.args import OneLineErrorParser
from llmrpc.engine.request import DEFAULT_MAX_JSON_WHITESPACE
from llmrpc.server import options
from llmrpc.server.structured_output import engine_spec
from llmrpc.v1 import common_pb2

SERVE_PARSER = OneLineErrorParser(prog="llmrpc serve", add_help=False)
options.add_serve_arguments(SERVE_PARSER)


def _config(*argv: str):
    engine, _ = options.build_configs(options.parse_serve_values(SERVE_PARSER, list(argv)))
    return engine.structured_output


def test_json_whitespace_is_bounded_by_default_and_the_flag_sets_or_lifts_it():
    assert _config().max_whitespace == DEFAULT_MAX_JSON_WHITESPACE == 16
    assert _config("--structured-output-max-whitespace", "4").max_whitespace == 4
    assert _config("--structured-output-max-whitespace", "none").max_whitespace is None
    message = common_pb2.StructuredOutput(json_schema='{"type": "object"}')
    assert engine_spec(message, _config()).max_whitespace == 16
    lifted = _config("--structured-output-max-whitespace", "none")
    assert engine_spec(message, lifted).max_whitespace is None


def test_the_compile_timeout_has_a_default_and_a_checked_flag(capsys):
    assert _config().compile_timeout_s == 30.0
    assert _config("--structured-output-compile-timeout", "2.5").compile_timeout_s == 2.5
    for bad in ("0", "nan", "-1"):
        with pytest.raises(SystemExit):
            options.configs_or_exit(
                SERVE_PARSER,
                options.parse_serve_values(
                    SERVE_PARSER, ["--structured-output-compile-timeout", bad]
                ),
            )
        assert "--structured-output-compile-timeout" in capsys.readouterr().err
