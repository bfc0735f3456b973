"""One request's fan-out is bounded: prompts per request (--max-prompts-per-request) and
sequences, prompts x n (--max-sequences-per-request), on REST and gRPC alike, each a 400 /
INVALID_ARGUMENT naming the field in the caller's terms; and a multi-prompt REST request counts
whole against --max-waiting-requests (it used to reach the server one prompt at a time)."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from envoy_support import Replica, tiny_engine_config
from gateway_support import RunningGateway, post, running_gateway

from llmrpc import cli
from llmrpc.cli.rest import gateway_settings
from llmrpc.clients import Client, LlmrpcError
from llmrpc.gateway import cli as gateway_cli
from llmrpc.gateway.settings import ApiSettings
from llmrpc.server import options
from llmrpc.server.settings import FrontendConfig, LimitsConfig

MAX_PROMPTS = 4
MAX_SEQUENCES = 16
MAX_WAITING = 8
LIMITS = {"max_prompts_per_request": MAX_PROMPTS, "max_sequences_per_request": MAX_SEQUENCES}


@pytest.fixture(scope="module")
def replica(server_loop, tiny_llama_dir) -> Iterator[Replica]:
    limits = LimitsConfig(max_waiting_requests=MAX_WAITING, **LIMITS)
    frontend = FrontendConfig(host="127.0.0.1", grpc_port=0, limits=limits)
    started = server_loop.start_replica(tiny_engine_config(tiny_llama_dir), frontend=frontend)
    yield started
    started.stop()


@pytest.fixture(scope="module")
def gateway(server_loop, replica) -> Iterator[RunningGateway]:
    """As llmrpc serve runs it: through the in-process channel, with the serve flags' bounds."""
    channels = {"in-process": replica.running.loopback}
    with running_gateway(server_loop, ["in-process"], channels, api=LIMITS) as started:
        yield started


def assert_400(reply, param: str, flag: str) -> None:
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param, error
    assert flag in error["message"], error


def complete(gateway, prompt, n: int = 1):
    body = {"prompt": prompt, "n": n, "max_tokens": 1, "temperature": 0}
    return post(gateway, "/v1/completions", body)


def test_more_prompts_than_the_bound_is_a_400_naming_prompt(gateway):
    assert_400(complete(gateway, ["Hi"] * (MAX_PROMPTS + 1)), "prompt", "--max-prompts-per-request")
    token_ids = [[1, 2]] * (MAX_PROMPTS + 1)
    assert_400(complete(gateway, token_ids), "prompt", "--max-prompts-per-request")


def test_prompts_times_n_beyond_the_bound_is_a_400(gateway):
    reply = complete(gateway, ["Hi"] * MAX_PROMPTS, n=MAX_SEQUENCES // MAX_PROMPTS + 1)
    assert_400(reply, "prompt", "--max-sequences-per-request")
    assert_400(complete(gateway, "Hi", n=MAX_SEQUENCES + 1), "n", "--max-sequences-per-request")


def test_chat_n_beyond_the_bound_is_a_400_naming_n(gateway):
    body = {"messages": [{"role": "user", "content": "Hi"}], "n": MAX_SEQUENCES + 1}
    reply = post(gateway, "/v1/chat/completions", body)
    assert_400(reply, "n", "--max-sequences-per-request")


def test_embeddings_inputs_beyond_the_bound_is_a_400_naming_input(gateway):
    reply = post(gateway, "/v1/embeddings", {"input": ["Hi"] * (MAX_PROMPTS + 1)})
    assert_400(reply, "input", "--max-prompts-per-request")


def test_a_multi_prompt_request_counts_whole_against_the_waiting_queue(gateway):
    """3 prompts x n=3 = 9 sequences: each prompt's 3 fit the queue of 8, the request never
    (it used to be a 429 once its third prompt found the queue full, as if a retry could help).
    """
    reply = complete(gateway, ["Hi", "Hello", "Hey"], n=3)
    assert_400(reply, "prompt", "--max-waiting-requests")
    reply = post(gateway, "/v1/completions", {"prompt": ["Hi"] * 3, "n": 3, "stream": True})
    assert_400(reply, "prompt", "--max-waiting-requests")
    assert complete(gateway, ["Hi", "Hello"], n=4).status_code == 200  # 8 fit


def test_grpc_n_beyond_the_bound_names_sampling_n(replica):
    with Client(replica.address) as client, pytest.raises(LlmrpcError) as failure:
        client.generate("Hi", n=MAX_SEQUENCES + 1, max_tokens=1)
    assert failure.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert [v.field for v in failure.value.field_violations] == ["sampling.n"]
    assert "--max-sequences-per-request" in failure.value.details.field_violations[0].description


def test_grpc_embed_inputs_beyond_the_bound_names_inputs(replica):
    with Client(replica.address) as client, pytest.raises(LlmrpcError) as failure:
        client.embed(["Hi"] * (MAX_PROMPTS + 1))
    assert failure.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert [v.field for v in failure.value.field_violations] == ["inputs"]
    assert "--max-prompts-per-request" in failure.value.details.field_violations[0].description


def _serve(*argv: str):
    parser = cli.build_parser()[1]
    _, frontend = options.build_configs(options.parse_serve_values(parser, ["m", *argv]))
    return frontend


def test_the_flags_of_serve_and_gateway_and_their_defaults():
    frontend = _serve()
    assert frontend.limits.max_prompts_per_request == 2048
    assert frontend.limits.max_sequences_per_request == 2048
    frontend = _serve("--max-prompts-per-request", "7", "--max-sequences-per-request", "9")
    assert (frontend.limits.max_prompts_per_request, frontend.limits.max_sequences_per_request) == (
        7,
        9,
    )
    api = gateway_settings(frontend).api  # llmrpc serve's own gateway applies them too
    assert (api.max_prompts_per_request, api.max_sequences_per_request) == (7, 9)
    parser = gateway_cli.build_parser()
    api = gateway_cli.settings_from_args(parser.parse_args(["--backend", "x:1"])).api
    assert (api.max_prompts_per_request, api.max_sequences_per_request) == (2048, 2048)
    args = parser.parse_args(["--backend", "x:1", "--max-sequences-per-request", "5"])
    assert gateway_cli.settings_from_args(args).api.max_sequences_per_request == 5
    for flag in ("--max-prompts-per-request", "--max-sequences-per-request"):
        with pytest.raises(ValueError, match=flag):
            _serve(flag, "0")
    with pytest.raises(ValueError, match="--max-prompts-per-request"):
        ApiSettings(max_prompts_per_request=0)
