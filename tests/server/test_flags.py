"""The flag table against vllm serve's flags (vllm_serve_flags.txt): every flag there is accepted
and in one state, with vLLM's aliases and defaults; refused flags refuse, inert flags warn,
working flags land in a configuration field; vLLM's value syntax (--config YAML, dotted JSON
keys, -O3, --no- booleans); a mistyped flag names the closest one."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from pathlib import Path
from typing import NamedTuple

import pytest

from llmrpc.common.args import OneLineErrorParser
from llmrpc.engine.config import StructuredOutputConfig
from llmrpc.server import options
from llmrpc.server.flag_table import _REST_FLAGS, FLAGS
from llmrpc.server.flags import Flag, State, human_readable_int, json_value

VLLM_FLAGS = Path(__file__).with_name("vllm_serve_flags.txt")
SERVE_PARSER = OneLineErrorParser(prog="llmrpc serve", add_help=False)
options.add_serve_arguments(SERVE_PARSER)


def parse(*argv: str) -> options.ServeValues:
    return options.parse_serve_values(SERVE_PARSER, list(argv))


def serve_error(capsys, *argv: str) -> str:
    """The one line ``llmrpc serve ARGV`` ends with (exit status 2) before serving."""
    with pytest.raises(SystemExit) as exit_info:
        options.configs_or_exit(SERVE_PARSER, parse(*argv))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("llmrpc serve: error: "), err
    return err.removeprefix("llmrpc serve: error: ").removesuffix("\n")


class VllmFlag(NamedTuple):
    names: tuple[str, ...]  # the name, then its aliases
    default: object = None
    has_default: bool = False  # the reference states the default


def vllm_flags() -> list[VllmFlag]:
    """The rows of vllm_serve_flags.txt: ``NAME [ALIAS...] [= JSON default]``."""
    rows = []
    for line in VLLM_FLAGS.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        names, has_default, default = line.partition(" = ")
        rows.append(
            VllmFlag(tuple(names.split()), json.loads(default or "null"), bool(has_default))
        )
    return rows


def _unset(value) -> bool:
    return value is None or value == ()  # () is "none given" of a flag taking several values


def disagreements(row: VllmFlag, flags_by_name: dict[str, Flag]) -> list[str]:
    """How the flag table departs from one vLLM flag: missing names, aliases, a wrong default."""
    name, *aliases = row.names
    if name.endswith("-*"):  # a family, e.g. --eplb-*
        family = name.removesuffix("*")
        return [] if any(n.startswith(family) for n in flags_by_name) else [f"no {name} flag"]
    if name.startswith("--no-") and name not in flags_by_name:
        flag = flags_by_name.get("--" + name.removeprefix("--no-"))
        return [] if flag is not None and flag.is_bool else [f"{name}: no boolean to negate"]
    flag = flags_by_name.get(name)
    if flag is None:
        return [f"{name} is missing"]
    found = [f"{name}: alias {alias} is missing" for alias in aliases if alias not in flag.names]
    if row.has_default and not (
        flag.default == row.default or _unset(flag.default) and _unset(row.default)
    ):
        found.append(f"{name}: default {flag.default!r}, vLLM's is {row.default!r}")
    return found


def test_the_reference_lists_many_flags():
    names = {name for row in vllm_flags() for name in row.names}
    assert len(names) > 180
    assert {
        "--hf-overrides",
        "-O",
        "--data-parallel-rpc-port",
        "--no-enable-prefix-caching",
    } <= names
    assert sum(row.has_default for row in vllm_flags()) > 40


@pytest.mark.parametrize("row", vllm_flags(), ids=lambda row: row.names[0])
def test_every_vllm_flag_is_in_the_table_with_its_aliases_and_default(row):
    assert disagreements(row, options.FLAGS_BY_NAME) == []
    if row.names[0] in options.FLAGS_BY_NAME:
        assert isinstance(options.FLAGS_BY_NAME[row.names[0]].state, State)


def test_the_comparison_catches_a_missing_flag_alias_or_wrong_default():
    table = dict(options.FLAGS_BY_NAME)
    port = VllmFlag(("--port",), 8000, True)
    assert disagreements(port, table) == []
    assert disagreements(VllmFlag(("--port",), 8080, True), table) == [
        "--port: default 8000, vLLM's is 8080"
    ]
    assert disagreements(VllmFlag(("--compilation-config", "-C")), table) == [
        "--compilation-config: alias -C is missing"
    ]
    del table["--port"]
    assert disagreements(port, table) == ["--port is missing"]
    assert disagreements(VllmFlag(("--no-port",)), table) == ["--no-port: no boolean to negate"]
    assert disagreements(VllmFlag(("--nothing-*",)), table) == ["no --nothing-* flag"]


def test_each_flag_is_in_the_table_once():
    names = [name for flag in FLAGS for name in flag.names]
    assert len(names) == len(set(names))


def test_every_rest_gateway_option_is_a_serve_flag():
    """llmrpc gateway and llmrpc serve take the same REST options (one declaration each)."""
    names = {name for flag in FLAGS for name in flag.names}
    assert set(_REST_FLAGS) - names == set()


def test_strict_request_fields_reaches_the_rest_gateway():
    _, frontend = options.build_configs(parse("--strict-request-fields"))
    assert frontend.rest_api.strict_request_fields
    _, frontend = options.build_configs(parse())
    assert not frontend.rest_api.strict_request_fields


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
    assert serve_error(capsys, "-pp", "2") == (
        "--pipeline-parallel-size 2 is refused: this flag splits a model by layers; this build "
        "splits one by tensor parallelism only (--tensor-parallel-size); leave it at its "
        "default (1)"
    )


def test_tensor_parallel_flags_reach_the_engine_config_or_are_refused(capsys):
    engine, _ = options.build_configs(parse("-tp", "2"))
    assert engine.parallel.tensor_parallel_size == 2
    ray, _ = options.build_configs(parse("-tp", "2", "--distributed-executor-backend", "ray"))
    assert ray.parallel.distributed_executor_backend == "ray"
    argv = ("-tp", "2", "--distributed-executor-backend", "external_launcher")
    assert serve_error(capsys, *argv) == (
        "--distributed-executor-backend external_launcher is refused: this build starts its "
        "tensor-parallel ranks itself (mp: local processes; ray: Ray actors)"
    )
    assert "--enable-lora is refused with --tensor-parallel-size 2" in serve_error(
        capsys, "-tp", "2", "--enable-lora"
    )


def test_device_and_attention_backend_reach_the_model_config(capsys):
    for device in ("auto", "cuda", "cpu"):
        for backend in ("auto", "torch", "triton"):
            engine, _ = options.build_configs(
                parse("--device", device, "--attention-backend", backend)
            )
            assert (engine.model.device, engine.model.attention_backend) == (device, backend)
    with pytest.raises(SystemExit):
        parse("--device", "tpu")
    assert "invalid choice: 'tpu'" in capsys.readouterr().err


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


# --- mistyped flags --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--max-model-lenn", "4k"],
            "unrecognized argument --max-model-lenn; did you mean --max-model-len?",
        ),
        (
            ["--max-model-lenn=4k"],
            "unrecognized argument --max-model-lenn; did you mean --max-model-len?",
        ),
        (
            ["some/model", "--no-enable-prefix-cachng"],
            "unrecognized argument --no-enable-prefix-cachng; did you mean "
            "--no-enable-prefix-caching?",
        ),
        (["-tpp", "2"], "unrecognized argument -tpp; did you mean -tp?"),
        (["one/model", "another/model"], "unrecognized argument another/model"),
        (["--frobnicate"], "unrecognized argument --frobnicate"),
        (
            ["--verbose", "--prot", "80"],
            "unrecognized arguments: --verbose, --prot (did you mean --port?)",
        ),
    ],
)
def test_an_unknown_flag_is_one_line_naming_the_closest_known_one(capsys, argv, message):
    assert serve_error(capsys, *argv) == message


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


def compilation_of(*argv: str):
    engine_config, _ = options.build_configs(parse(*argv))
    return engine_config.compilation


@pytest.mark.parametrize(
    ("argv", "level"),
    [
        ([], 0),  # eager by default
        (["-O3"], 3),
        (["-O", "0"], 0),
        (["-O1"], 1),
        (["--compilation-config", '{"level": 3}'], 3),
        (["--compilation-config", '{"mode": 2}'], 2),  # newer vLLM's name for it
        (["--compilation-config.level", "2"], 2),
    ],
)
def test_compilation_level_reaches_the_engine_config(argv, level):
    assert compilation_of(*argv).level == level


def test_enforce_eager_forces_level_0():
    compilation = compilation_of("--enforce-eager", "-O3")
    assert compilation.level == 0 and compilation.requested_level == 3
    assert compilation_of("--no-enforce-eager", "-O3").level == 3


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--compilation-config", '{"level": 3, "cudagraph_capture_sizes": [1, 2]}'],
            "--compilation-config: unknown key 'cudagraph_capture_sizes'; this build takes "
            'only "level" (or "mode", vLLM\'s newer name for it), one of 0, 1, 2, 3',
        ),
        (
            ["--compilation-config.backend", "eager", "--compilation-config.use_inductor=true"],
            "--compilation-config: unknown keys 'backend', 'use_inductor'; this build takes "
            'only "level" (or "mode", vLLM\'s newer name for it), one of 0, 1, 2, 3',
        ),
        (["-O4"], "--compilation-config: level must be one of 0, 1, 2, 3, got 4"),
        (
            ["--compilation-config", '{"level": "3"}'],
            "--compilation-config: level must be one of 0, 1, 2, 3, got '3'",
        ),
        (
            ["--compilation-config", '{"level": 3, "mode": 0}'],
            '--compilation-config: "level" and "mode" name the same setting and disagree (3 and 0)',
        ),
    ],
)
def test_bad_compilation_config_is_one_line_naming_what_is_wrong(capsys, argv, message):
    assert serve_error(capsys, *argv) == message


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
        ("no-such-flag: 1\n", "'no-such-flag' is not a serve flag\n"),
        (
            "max_model_lenn: 4k\n",
            "'max_model_lenn' is not a serve flag; did you mean 'max-model-len'?\n",
        ),
        ("- a list\n", "expected a mapping"),
        ("pipeline-parallel-size: 2\n", "--pipeline-parallel-size 2 is refused"),
    ],
)
def test_bad_config_file_is_one_line(tmp_path, capsys, content, message):
    config = tmp_path / "serve.yaml"
    config.write_text(content)
    assert message.rstrip("\n") in serve_error(capsys, "--config", str(config)) + "\n"


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


def test_guided_decoding_flags_reach_the_engine_and_a_missing_backend_says_so():
    engine, _ = options.build_configs(
        parse(
            "--guided-decoding-backend", "guidance", "--guided-decoding-disable-fallback",
            "--guided-decoding-disable-any-whitespace",
            "--guided-decoding-disable-additional-properties",
        )
    )  # fmt: skip
    assert engine.structured_output == StructuredOutputConfig("guidance", True, True, True)
    with pytest.raises(ValueError, match="outlines and lm-format-enforcer are not in this build"):
        options.build_configs(parse("--guided-decoding-backend", "outlines"))


def test_speculative_config_reaches_the_engine_as_json_or_dotted_keys():
    whole = parse("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}')
    dotted = parse(
        "--speculative-config.method", "ngram", "--speculative-config.num_speculative_tokens=3"
    )
    for values in (whole, dotted):
        speculative = options.build_configs(values)[0].speculative
        assert (speculative.method, speculative.num_speculative_tokens) == ("ngram", 3)
        assert (speculative.prompt_lookup_min, speculative.prompt_lookup_max) == (5, 5)
    assert not options.build_configs(parse())[0].speculative.enabled
    draft = parse(
        "--speculative-config.model", "org/small-draft",
        "--speculative-config.num_speculative_tokens", "4",
    )  # fmt: skip
    speculative = options.build_configs(draft)[0].speculative
    assert (speculative.method, speculative.model) == ("draft_model", "org/small-draft")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--speculative-config", '{"method": "eagle3", "num_speculative_tokens": 3}'],
            "--speculative-config: method 'eagle3' needs EAGLE-3 draft heads, which this build "
            "does not have; it speculates with ngram and draft_model",
        ),
        (
            ["--speculative-config.method", "ngram", "--speculative-config.num_speculative_tokens",
             "3", "--speculative-config.draft_tensor_parallel_size", "1"],
            "--speculative-config: 'draft_tensor_parallel_size' is not used by method ngram; it "
            "takes disable_by_batch_size, max_model_len, method, model, num_speculative_tokens, "
            "prompt_lookup_max, prompt_lookup_min",
        ),
        (
            ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}',
             "--tensor-parallel-size", "2"],
            "--speculative-config is refused with --tensor-parallel-size 2 in this build",
        ),
    ],
)  # fmt: skip
def test_bad_speculative_config_is_one_line_naming_what_is_wrong(capsys, argv, message):
    assert serve_error(capsys, *argv) == message
