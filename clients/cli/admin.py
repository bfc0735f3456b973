"""``llmrpc admin VERB``: server and model information, health and request control, as JSON."""

from __future__ import annotations

import argparse
import os

from llmrpc.clients.cli import common

# Preferred to LLMRPC_API_KEY by the admin verbs, so one environment can hold both keys: the
# generation verbs send the generation key, these the admin key (server's --admin-api-key).
ADMIN_API_KEY_ENV = "LLMRPC_ADMIN_API_KEY"


def _info(client, args) -> int:
    common.print_json(
        {"server": client.server_info(), "model": client.model_info(args.model)}, indent=2
    )
    return common.EXIT_OK


def _models(client, args) -> int:
    common.print_json(client.models(), indent=2)
    return common.EXIT_OK


def _abort(client, args) -> int:
    common.print_json({"aborted_request_ids": client.abort(*args.request_ids)})
    return common.EXIT_OK


def _load(client, args) -> int:
    common.print_json(client.load(), indent=2)
    return common.EXIT_OK


def _reset_prefix_cache(client, args) -> int:
    client.reset_prefix_cache()
    common.print_json({"prefix_cache_reset": True})
    return common.EXIT_OK


def _sleep(client, args) -> int:
    client.sleep(args.level)
    common.print_json({"is_sleeping": client.is_sleeping()})
    return common.EXIT_OK


def _wake(client, args) -> int:
    client.wake_up()
    common.print_json({"is_sleeping": client.is_sleeping()})
    return common.EXIT_OK


def _lora_load(client, args) -> int:
    adapter = client.load_lora_adapter(args.name, args.path, base_model_name=args.base_model_name)
    common.print_json(adapter)
    return common.EXIT_OK


def _lora_unload(client, args) -> int:
    client.unload_lora_adapter(args.name)
    common.print_json({"unloaded": args.name})
    return common.EXIT_OK


def _lora_list(client, args) -> int:
    common.print_json(client.lora_adapters(), indent=2)
    return common.EXIT_OK


def _health(client, args) -> int:
    status = client.health(args.service)
    print(status)
    return common.EXIT_OK if status == "SERVING" else common.EXIT_UNAVAILABLE


def _request_id(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("a request id must not be empty")
    return text


def build_parser() -> common.Parser:
    parser = common.Parser(
        prog="llmrpc admin",
        description="Ask a running server about itself, or control its requests. Output is JSON. "
        f"The API key comes from --api-key, else {ADMIN_API_KEY_ENV}, else LLMRPC_API_KEY; "
        "reset-prefix-cache, sleep, wake, lora-load and lora-unload need the admin key of a "
        "server with --admin-api-key.",
    )
    commands = parser.add_subparsers(dest="verb", metavar="VERB", required=True)

    def add(name: str, run, help_text: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help_text, description=help_text)
        sub.set_defaults(run=run)
        common.add_connection_arguments(sub)
        sub.set_defaults(api_key=os.environ.get(ADMIN_API_KEY_ENV) or sub.get_default("api_key"))
        return sub

    info = add("info", _info, "Server version, capabilities, configuration, and model facts.")
    info.add_argument("--model", default="", help="Model to describe (default: the server's).")
    add("models", _models, "The served models, the default first.")
    add("load", _load, "Requests running and waiting, KV cache usage, throughput, sleep state.")
    abort = add("abort", _abort, "Abort running or queued requests by id.")
    abort.add_argument(
        "request_ids",
        nargs="+",
        type=_request_id,
        metavar="REQUEST_ID",
        help="Ids the requests were sent with (e.g. `llmrpc generate --request-id ID`).",
    )
    add("reset-prefix-cache", _reset_prefix_cache, "Forget every cached prefix (when idle).")
    sleep = add("sleep", _sleep, "Free memory while idle (server needs --enable-sleep-mode).")
    sleep.add_argument(
        "--level", type=int, choices=(1, 2), help="1: drop the KV cache (default); 2: weights too."
    )
    add("wake", _wake, "Restore what sleep freed (server needs --enable-sleep-mode).")
    lora_load = add(
        "lora-load", _lora_load, "Load a PEFT LoRA adapter (server needs --enable-lora)."
    )
    lora_load.add_argument(
        "name", metavar="NAME", help="The name requests will use (the lora field; OpenAI's model)."
    )
    lora_load.add_argument(
        "path",
        metavar="PATH",
        help="The adapter's folder on the server's machine (adapter_config.json and "
        "adapter_model.safetensors).",
    )
    lora_load.add_argument(
        "--base-model-name", default="", help="The served model it adapts (default: the server's)."
    )
    lora_unload = add(
        "lora-unload", _lora_unload, "Unload a LoRA adapter; requests running with it finish."
    )
    lora_unload.add_argument("name", metavar="NAME", help="The adapter's name.")
    add("lora-list", _lora_list, "The loaded LoRA adapters, oldest first.")
    health = add("health", _health, "Print the health status; exit 0 only when SERVING.")
    health.add_argument("--service", default="", help="A service's full name (default: all).")
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)

    def command() -> int:
        with common.client_from_args(args) as client:
            return args.run(client, args)

    return common.run_command(command)
