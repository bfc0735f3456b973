"""The flag table against SERVE_OPTIONS.md: every flag there is accepted and in one state;
refused flags refuse, inert flags warn, working flags land in a configuration field; vLLM's
value syntax (--config YAML, dotted JSON keys, -O3, --no- booleans)."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from pathlib import Path

import pytest

from llmrpc import cli
from llmrpc.server import options
from llmrpc.server.flag_table import FLAGS
from llmrpc.server.flags import Flag, State, human_readable_int, json_value

SERVE_OPTIONS = Path(__file__).resolve().parents[3] / "shared" / "SERVE_OPTIONS.md"
# Syntax examples in the document, and argparse's own --help: not rows of the table.
PLACEHOLDERS = {"--flag", "--no-flag", "--help"}
_, SERVE_PARSER = cli.build_parser()


def parse(*argv: str) -> options.ServeValues:
    return options.parse_serve_values(SERVE_PARSER, list(argv))


def _expand_braces(token: str) -> list[str]:
    match = re.search(r"\{([^}]*)\}", token)
    if match is None:
        return [token]
    head, tail = token[: match.start()], token[match.end() :]
    parts = match.group(1).split(",")
    return [name for part in parts for name in _expand_braces(head + part + tail)]


def documented_flags() -> set[str]:
    """Every flag name in SERVE_OPTIONS.md's backticks, braces expanded, dotted keys dropped."""
    names = set()
    for quoted in re.findall(r"`([^`]+)`", SERVE_OPTIONS.read_text()):
        word = quoted.split()[0]
        if not word.startswith("-") or word in PLACEHOLDERS:
            continue
        for name in _expand_braces(word):
            names.add(re.sub(r"^(-O)\d+$", r"\1", name.split(".")[0]))
    return names


def test_the_document_lists_many_flags():
    names = documented_flags()
    assert len(names) > 180
    assert {
        "--hf-overrides",
        "-O",
        "--data-parallel-rpc-port",
        "--no-enable-prefix-caching",
    } <= names


@pytest.mark.parametrize("name", sorted(documented_flags()))
def test_every_documented_flag_is_in_the_table_with_a_state(name):
    if name.endswith("-*"):  # a family, e.g. --eplb-*
        assert any(flag.name.startswith(name[:-1]) for flag in FLAGS), name
        return
    if name.startswith("--no-") and name not in options.FLAGS_BY_NAME:
        flag = options.FLAGS_BY_NAME["--" + name.removeprefix("--no-")]
        assert flag.is_bool, f"{name}: only booleans have a --no- form"
        return
    assert name in options.FLAGS_BY_NAME, f"{name} is missing from the flag table"
    assert isinstance(options.FLAGS_BY_NAME[name].state, State)


def test_each_flag_is_in_the_table_once():
    names = [name for flag in FLAGS for name in flag.names]
    assert len(names) == len(set(names))


# --- states ----------------------------------------------------------------------------------


def non_default_argv(flag: Flag) -> list[str]:
    """The flag set to a value it does not take by default."""
    if flag.is_bool:
        return ["--no-" + flag.name[2:] if flag.default else flag.name]
    if flag.choices:
        value = next(str(c) for c in flag.choices if not flag.honours(c))
    elif flag.is_json:
        value = '{"x": 1}'
    elif flag.parse is json_value:
        value = '["https://example.test"]'
    elif flag.parse in (int, human_readable_int, float):
        value = str((flag.default or 0) + 3)
    else:
        value = "something-else"
    return [flag.name, value]


REFUSED = [flag for flag in FLAGS if flag.state is State.REFUSED]
INERT = [flag for flag in FLAGS if flag.state is State.INERT]
WORKS = [flag for flag in FLAGS if flag.state is State.WORKS]


@pytest.mark.parametrize("flag", REFUSED, ids=lambda flag: flag.name)
def test_refused_flag_stops_start_up_with_its_reason_and_takes_its_default(flag):
    argv = non_default_argv(flag)
    with pytest.raises(ValueError, match=re.escape(flag.name)) as refusal:
        options.build_configs(parse(*argv))
    assert "refused" in str(refusal.value) and flag.help in str(refusal.value)
    options.build_configs(parse(*_default_argv(flag)))  # the default, given explicitly: fine


def _default_argv(flag: Flag) -> list[str]:
    if flag.is_bool:
        return [flag.name if flag.default else "--no-" + flag.name[2:]]
    if flag.default in (None, []):
        return []
    default = flag.default
    if flag.is_json or isinstance(default, list) and flag.nargs is None:
        return [flag.name, json.dumps(default)]
    if isinstance(default, list):
        return [flag.name, *map(str, default)]
    return [flag.name, str(default)]


def test_refusal_is_one_line_naming_the_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "-tp", "2"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (
        "llmrpc serve: error: --tensor-parallel-size 2 is refused: this flag needs several "
        "devices or processes; this build runs the engine on one device; leave it at its default "
        "(1)\n"
    )


@pytest.mark.parametrize("flag", INERT, ids=lambda flag: flag.name)
def test_inert_flag_is_accepted_with_one_warning(flag, caplog):
    serve = parse(*non_default_argv(flag))
    options.build_configs(serve)
    with caplog.at_level(logging.WARNING):
        options.warn_about_inert_flags(serve, logging.getLogger("test"))
    assert [r.getMessage() for r in caplog.records] == [
        f"{flag.name} has no effect in llmrpc: this flag {flag.help}"
    ]


def test_no_warning_for_flags_not_given(caplog):
    with caplog.at_level(logging.WARNING):
        options.warn_about_inert_flags(parse(), logging.getLogger("test"))
    assert not caplog.records


@pytest.mark.parametrize("flag", [f for f in WORKS if f.target], ids=lambda flag: flag.name)
def test_working_flag_targets_a_configuration_field(flag):
    section, name = flag.target.split(".")
    fields = {field.name for field in dataclasses.fields(options.SECTIONS[section])}
    assert name in fields


def test_help_shows_every_flag_and_its_state(capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    help_text = capsys.readouterr().out
    for flag in FLAGS:
        assert re.search(rf"^\s+{re.escape(flag.name)}\b", help_text, re.MULTILINE), flag.name
    # Each tag once per flag in its state, and once more where the epilog explains it.
    assert help_text.count("[refused]") == len(REFUSED) + 1
    assert help_text.count("[inert]") == len(INERT) + 1
    assert help_text.count("(llmrpc)") == sum(flag.ours for flag in FLAGS) + 1


# --- value syntax ----------------------------------------------------------------------------


def test_dotted_keys_are_the_json_object():
    dotted = parse("--compilation-config.level", "3", "--compilation-config.cudagraph.sizes=[1, 2]")
    whole = parse("--compilation-config", '{"level": 3, "cudagraph": {"sizes": [1, 2]}}')
    assert dotted.values["compilation_config"] == whole.values["compilation_config"]
    scientific = parse("--hf-overrides.rope_theta", "1e6").values["hf_overrides"]
    assert scientific == {"rope_theta": 1e6}


def test_dash_o_is_the_compilation_level():
    expected = {"level": 3}
    assert parse("-O3").values["compilation_config"] == expected
    assert parse("-O", "3").values["compilation_config"] == expected
    assert parse("--compilation-config", '{"level": 3}').values["compilation_config"] == expected


def test_no_booleans_and_default_on_flags():
    assert not parse("--no-enable-prefix-caching").values["enable_prefix_caching"]
    assert parse("--enable-prefix-caching").values["enable_prefix_caching"]
    engine_config, _ = options.build_configs(parse("--no-enable-chunked-prefill"))
    assert not engine_config.scheduler.enable_chunked_prefill


def test_config_file_gives_flags_and_the_command_line_wins(tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text(
        "model: some/model\n"
        "max-model-len: 2k\n"
        "max_num_seqs: 8\n"
        "enable-prefix-caching: false\n"
        "served-model-name: [a, b]\n"
        "compilation-config: {level: 2}\n"
        "grpc-port: 7000\n"
    )
    serve = parse("--config", str(config), "--grpc-port", "7001", "--max-num-seqs", "4")
    engine_config, frontend = options.build_configs(serve)
    assert engine_config.model.model == "some/model"
    assert engine_config.model.max_model_len == 2000
    assert engine_config.model.served_model_name == ("a", "b")
    assert not engine_config.cache.enable_prefix_caching
    assert engine_config.scheduler.max_num_seqs == 4  # the command line wins
    assert frontend.grpc_port == 7001
    assert serve.values["compilation_config"] == {"level": 2}
    assert "compilation_config" in serve.given  # so it warns like a command-line flag


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("no-such-flag: 1\n", "'no-such-flag' is not a serve flag"),
        ("- a list\n", "expected a mapping"),
        ("tensor-parallel-size: 2\n", "--tensor-parallel-size 2 is refused"),
    ],
)
def test_bad_config_file_is_one_line(tmp_path, capsys, content, message):
    config = tmp_path / "serve.yaml"
    config.write_text(content)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "--config", str(config)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_engine_flags_reach_the_engine_config():
    engine_config, _ = options.build_configs(
        parse(
            "--hf-overrides.rms_norm_eps", "1e-3",
            "--rope-theta", "5e5",
            "--rope-scaling", '{"rope_type": "linear", "factor": 2}',
            "--max-logprobs", "5",
            "--logprobs-mode", "processed_logits",
            "--generation-config", "vllm",
            "--override-generation-config", '{"temperature": 0.5}',
            "--model-impl", "transformers",
            "--skip-tokenizer-init",
            "--prefix-caching-hash-algo", "sha256",
            "--max-num-partial-prefills", "4",
            "--max-long-partial-prefills", "2",
            "--long-prefill-token-threshold", "1k",
            "--scheduling-policy", "priority",
            "--preemption-mode", "recompute",
        )
    )  # fmt: skip
    model, cache, scheduler = engine_config.model, engine_config.cache, engine_config.scheduler
    assert model.hf_overrides == {"rms_norm_eps": 1e-3}
    assert model.rope_theta == 5e5 and model.rope_scaling == {"rope_type": "linear", "factor": 2}
    assert (model.max_logprobs, model.logprobs_mode) == (5, "processed_logits")
    assert model.generation_config == "vllm"
    assert model.override_generation_config == {"temperature": 0.5}
    assert model.model_impl == "transformers" and model.skip_tokenizer_init
    assert cache.prefix_caching_hash_algo == "sha256"
    assert (scheduler.max_num_partial_prefills, scheduler.max_long_partial_prefills) == (4, 2)
    assert scheduler.long_prefill_token_threshold == 1000
    assert scheduler.scheduling_policy == "priority"


def test_swap_preemption_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="--preemption-mode swap is refused"):
        options.build_configs(parse("--preemption-mode", "swap"))
