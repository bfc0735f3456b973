"""``llmrpc serve`` option parsing: vLLM's names, defaults and value syntax; one-line errors."""

from __future__ import annotations

import json
import logging

import pytest

from llmrpc import cli
from llmrpc.engine.config import EngineConfig
from llmrpc.server import options
from llmrpc.server.flags import human_readable_int
from llmrpc.server.logs import configure_logging, request_id_var
from llmrpc.server.settings import FrontendConfig, LogConfig

_, SERVE_PARSER = cli.build_parser()


def configs(*argv: str):
    return options.build_configs(options.parse_serve_values(SERVE_PARSER, list(argv)))


@pytest.fixture(autouse=True)
def no_api_key_in_the_environment(monkeypatch):
    monkeypatch.delenv(options.API_KEY_ENV, raising=False)


def test_vllm_api_key_from_the_environment_unless_the_flag_gives_keys(monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    assert configs()[1].api_key == ("from-env",)
    assert configs("--api-key", "a", "b")[1].api_key == ("a", "b")


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
    engine_config, _ = configs("--max-model-len", text)
    assert engine_config.model.max_model_len == value


def test_defaults_are_the_configurations_defaults():
    engine_config, frontend = configs()
    assert engine_config == EngineConfig()
    assert frontend == FrontendConfig()
    assert engine_config.model.model is None  # the packaged SmolLM2
    assert (frontend.host, frontend.grpc_port) == (None, 50051)
    assert engine_config.model.seed == 0
    assert engine_config.cache.enable_prefix_caching
    assert not frontend.api_key and not frontend.tls.enabled


def test_flags_reach_the_configurations(tmp_path):
    engine_config, frontend = configs(
        "some/model",
        "--served-model-name", "a", "b",
        "--no-enable-prefix-caching",
        "--kv-cache-memory", "0.5",
        "--num-gpu-blocks-override", "99",
        "--max-num-batched-tokens", "1k",
        "--grpc-port", "6000",
        "--api-key", "k1", "k2",
        "--enable-sleep-mode",
        "--max-waiting-requests", "8",
        "--grpc-max-receive-message-size", "2M",
        "--enable-log-requests", "--max-log-len", "40",
        "--drain-delay", "2.5",
    )  # fmt: skip
    assert engine_config.model.model == "some/model"
    assert engine_config.model.served_model_name == ("a", "b")
    assert engine_config.model.enable_sleep_mode
    assert not engine_config.cache.enable_prefix_caching
    assert engine_config.cache.kv_cache_memory_gib == 0.5
    assert engine_config.cache.num_gpu_blocks_override == 99
    assert engine_config.scheduler.max_num_batched_tokens == 1000
    assert frontend.grpc_port == 6000
    assert frontend.api_key == ("k1", "k2")
    assert frontend.limits.max_waiting_requests == 8
    assert frontend.limits.max_receive_message_size == 2 * 1024**2
    assert frontend.logs.enable_log_requests and frontend.logs.max_log_len == 40
    assert frontend.drain_delay_s == 2.5
    assert configs("--model", "other")[0].model.model == "other"


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
        (["--ssl-certfile", "c.pem"], "--ssl-keyfile"),
        (["--ssl-certfile", "c", "--ssl-keyfile", "k", "--ssl-cert-reqs", "2"], "--ssl-ca-certs"),
        (["--enable-ssl-refresh"], "--enable-ssl-refresh"),
        (["--ssl-cert-reqs", "3"], "--ssl-cert-reqs"),
        (["--tensor-parallel-size", "0"], "--tensor-parallel-size"),
        (["--hf-overrides", "[1]"], "--hf-overrides"),
        (["--grpc-max-concurrent-streams", "0"], "--grpc-max-concurrent-streams"),
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


def test_log_config_file_configures_every_logger_with_the_request_id(tmp_path):
    log_file = tmp_path / "server.log"
    config = {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"plain": {"format": "%(request_id)s|%(name)s|%(message)s"}},
        "handlers": {
            "file": {
                "class": "logging.FileHandler",
                "filename": str(log_file),
                "formatter": "plain",
            }
        },
        "root": {"level": "INFO", "handlers": ["file"]},
    }
    config_path = tmp_path / "logging.json"
    config_path.write_text(json.dumps(config))
    root = logging.getLogger()
    saved_handlers, saved_level = root.handlers[:], root.level
    try:
        configure_logging(LogConfig(config_file=str(config_path)))
        token = request_id_var.set("abc")
        logging.getLogger("llmrpc.test").info("hello")
        request_id_var.reset(token)
        logging.getLogger("llmrpc.test").info("bye")
        for handler in root.handlers:
            handler.flush()
        assert log_file.read_text().splitlines() == ["abc|llmrpc.test|hello", "-|llmrpc.test|bye"]
    finally:
        for handler in root.handlers:
            handler.close()
        root.handlers[:] = saved_handlers
        root.setLevel(saved_level)


def test_unreadable_log_config_file_exits_2_with_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "--log-config-file", str(tmp_path / "missing.json")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--log-config-file" in err, err


def test_no_command_prints_help_and_exits_2(capsys):
    assert cli.main([]) == 2
    assert "serve" in capsys.readouterr().err
