"""``llmrpc serve`` option parsing: vLLM's names, defaults and value syntax; one-line errors."""

from __future__ import annotations

import argparse

import pytest

from llmrpc.server import cli
from llmrpc.server.options import build_configs, human_readable_int


def parse(*argv: str) -> argparse.Namespace:
    parser, _ = cli.build_parser()
    return parser.parse_args(["serve", *argv])


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("4096", 4096),
        ("1k", 1000),
        ("1K", 1024),
        ("25.6k", 25_600),
        ("2m", 2_000_000),
        ("2M", 2 * 1024**2),
        ("32K", 32_768),
    ],
)
def test_max_model_len_takes_human_readable_sizes(text, value):
    assert human_readable_int(text) == value
    engine_config, _ = build_configs(parse("--max-model-len", text))
    assert engine_config.model.max_model_len == value


def test_defaults_are_vllms():
    engine_config, frontend = build_configs(parse())
    assert engine_config.model.model is None  # the packaged SmolLM2
    assert (frontend.host, frontend.grpc_port, frontend.port) == (None, 50051, 8000)
    assert engine_config.model.dtype == "auto"
    assert engine_config.model.seed == 0
    assert engine_config.cache.block_size == 16
    assert engine_config.cache.kv_cache_memory_gib == 4.0
    assert engine_config.cache.enable_prefix_caching
    assert engine_config.scheduler.max_num_seqs == 256


def test_flags_reach_the_engine_configuration():
    engine_config, frontend = build_configs(
        parse(
            "some/model",
            "--served-model-name", "a", "b",
            "--no-enable-prefix-caching",
            "--kv-cache-memory", "0.5",
            "--num-gpu-blocks-override", "99",
            "--max-num-batched-tokens", "512",
            "--grpc-port", "6000",
        )
    )  # fmt: skip
    assert engine_config.model.model == "some/model"
    assert engine_config.model.served_model_name == ("a", "b")
    assert not engine_config.cache.enable_prefix_caching
    assert engine_config.cache.kv_cache_memory_gib == 0.5
    assert engine_config.cache.num_gpu_blocks_override == 99
    assert engine_config.scheduler.max_num_batched_tokens == 512
    assert frontend.grpc_port == 6000
    assert build_configs(parse("--model", "other"))[0].model.model == "other"


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--dtype", "float64"], "--dtype"),
        (["--max-model-len", "12q"], "--max-model-len"),
        (["--max-model-len", "0.5"], "--max-model-len"),
        (["--max-model-len", "0"], "--max-model-len"),
        (["--block-size", "24"], "--block-size"),
        (["--max-num-seqs", "many"], "--max-num-seqs"),
        (["--kv-cache-memory", "-1"], "--kv-cache-memory"),
        (["--grpc-port", "70000"], "--grpc-port"),
        (["--load-format", "pt"], "--load-format"),
        (["a", "--model", "b"], "--model"),
    ],
)
def test_bad_value_exits_2_with_one_line_naming_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("llmrpc serve: error:")
    assert flag in err
    assert "Traceback" not in err


def test_help_documents_the_kv_cache_memory_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "--help"])
    assert exit_info.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--kv-cache-memory GIB" in help_text
    assert "host memory for the KV cache" in help_text
    assert "not served yet" in help_text  # --port


def test_no_command_prints_help_and_exits_2(capsys):
    assert cli.main([]) == 2
    assert "serve" in capsys.readouterr().err
