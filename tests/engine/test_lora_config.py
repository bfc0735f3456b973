"""``--enable-lora`` and its flags as ``llmrpc serve`` parses them into the engine's LoRAConfig."""

from __future__ import annotations

import argparse

import pytest

from llmrpc.engine.lora.types import LoRAConfig, LoRAModulePath
from llmrpc.server import options


def _configs(*argv: str):
    parser = argparse.ArgumentParser(add_help=False)
    options.add_serve_arguments(parser)
    return options.build_configs(options.parse_serve_values(parser, list(argv)))


def test_serve_flags_build_the_lora_config():
    engine, frontend = _configs(
        "--enable-lora",
        "--max-loras", "4",
        "--max-lora-rank", "32",
        "--max-cpu-loras", "6",
        "--lora-modules", "sql=/adapters/sql",
        '{"name": "poem", "path": "/adapters/poem", "base_model_name": "base"}',
    )  # fmt: skip
    assert engine.lora == LoRAConfig(
        enabled=True,
        max_loras=4,
        max_lora_rank=32,
        max_cpu_loras=6,
        lora_modules=(
            LoRAModulePath("sql", "/adapters/sql"),
            LoRAModulePath("poem", "/adapters/poem", "base"),
        ),
    )
    shown = options.effective_config(engine, frontend)["lora_modules"]
    assert shown.startswith("sql=/adapters/sql,")  # as the flag takes it
    assert not _configs()[0].lora.enabled


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--lora-modules", "a=/x"], "--lora-modules needs --enable-lora"),
        (["--enable-lora", "--lora-modules", "a"], "must be name=path"),
        (["--enable-lora", "--lora-modules", '{"name": "a"}'], '"path"'),
        (["--enable-lora", "--lora-modules", "a=/x", "a=/y"], "given twice"),
        (["--enable-lora", "--max-loras", "0"], "--max-loras must be at least 1"),
        (["--enable-lora", "--max-loras", "4", "--max-cpu-loras", "2"], "--max-cpu-loras"),
    ],
)
def test_bad_lora_flags_name_the_flag(argv, message):
    with pytest.raises(ValueError, match=message):
        _configs(*argv)
