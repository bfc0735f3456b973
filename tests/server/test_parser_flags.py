"""The tool-call and reasoning flags: their values reach the server's configuration, plugin files
load at start-up and add parser names, and a mistake (an unknown parser, a plugin that is not a
file or fails to import, auto tool choice without a parser) stops start-up with one line naming
the flag."""

from __future__ import annotations

import pytest

from llmrpc.common.args import OneLineErrorParser
from llmrpc.server import options
from llmrpc.server.output_parsing import OutputParsers
from llmrpc.server.reasoning_parsers import DeepSeekR1ReasoningParser
from llmrpc.server.tool_parsers import HermesToolParser

SERVE_PARSER = OneLineErrorParser(prog="llmrpc serve", add_help=False)
options.add_serve_arguments(SERVE_PARSER)

TOOL_PLUGIN = """
from llmrpc.server.tool_parsers import HermesToolParser, register_tool_parser

@register_tool_parser("my_calls")
class MyCalls(HermesToolParser):
    start_tag = "<call>"
    end_tag = "</call>"
"""
REASONING_PLUGIN = """
from llmrpc.server.reasoning_parsers import DeepSeekR1ReasoningParser, register_reasoning_parser

@register_reasoning_parser("my_thoughts")
class MyThoughts(DeepSeekR1ReasoningParser):
    pass
"""


def configs(*argv: str):
    return options.build_configs(options.parse_serve_values(SERVE_PARSER, list(argv)))


def serve_error(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        options.configs_or_exit(SERVE_PARSER, options.parse_serve_values(SERVE_PARSER, list(argv)))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err.removeprefix("llmrpc serve: error: ").removesuffix("\n")


def test_the_flags_reach_the_parsing_configuration():
    _, frontend = configs(
        "--enable-auto-tool-choice",
        "--tool-call-parser", "hermes",
        "--exclude-tools-when-tool-choice-none",
        "--reasoning-parser", "deepseek_r1",
    )  # fmt: skip
    parsing = frontend.parsing
    assert parsing.enable_auto_tool_choice and parsing.exclude_tools_when_tool_choice_none
    assert (parsing.tool_call_parser, parsing.reasoning_parser) == ("hermes", "deepseek_r1")
    parsers = OutputParsers.from_config(parsing)
    assert isinstance(parsers.tool_parser, HermesToolParser) and parsers.auto_tool_choice
    assert isinstance(parsers.reasoning_parser, DeepSeekR1ReasoningParser)
    # A parser without --enable-auto-tool-choice serves forced calls' ids, not tool_choice auto.
    _, frontend = configs("--tool-call-parser", "mistral")
    assert not OutputParsers.from_config(frontend.parsing).auto_tool_choice


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--enable-auto-tool-choice"], "--enable-auto-tool-choice requires --tool-call-parser"),
        (["--tool-call-parser", "nope"], "--tool-call-parser: unknown tool parser 'nope' (known: "),
        (["--reasoning-parser", "nope"], "--reasoning-parser: unknown reasoning parser 'nope'"),
        (["--tool-parser-plugin", "/no/such/plugin.py"], "--tool-parser-plugin: /no/such/"),
        (["--reasoning-parser-plugin", "/no/such.py"], "--reasoning-parser-plugin: /no/such.py"),
    ],
)
def test_a_mistake_stops_start_up_naming_the_flag(capsys, argv, message):
    assert serve_error(capsys, *argv).startswith(message)


def test_a_plugin_that_fails_to_import_stops_start_up(capsys, tmp_path):
    plugin = tmp_path / "broken.py"
    plugin.write_text("raise RuntimeError('broken plugin')\n")
    error = serve_error(capsys, "--tool-parser-plugin", str(plugin))
    assert error.startswith(f"--tool-parser-plugin: importing {plugin} failed")
    assert "broken plugin" in error


def test_plugins_add_parsers_the_flags_can_name(tmp_path):
    tools, reasoning = tmp_path / "tools.py", tmp_path / "reasoning.py"
    tools.write_text(TOOL_PLUGIN)
    reasoning.write_text(REASONING_PLUGIN)
    argv = ["--tool-parser-plugin", str(tools), "--reasoning-parser-plugin", str(reasoning)]
    _, frontend = configs(
        *argv, "--enable-auto-tool-choice", "--tool-call-parser", "my_calls",
        "--reasoning-parser", "my_thoughts",
    )  # fmt: skip
    parsers = OutputParsers.from_config(frontend.parsing)  # again, as the server does: no reload
    parsed = parsers.tool_parser.parse('Sure.<call>{"name": "f", "arguments": {"x": 1}}</call>')
    assert parsed.content == "Sure." and parsed.tool_calls[0].arguments == '{"x": 1}'
    assert parsers.reasoning_parser.parse("thinking</think>answer") == ("thinking", "answer")
