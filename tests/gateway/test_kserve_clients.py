"""KServe v2 / the Open Inference Protocol as ``llmrpc serve`` serves it: gRPC on the server's
port, REST on its gateway, one API key for both. tritonclient and kserve themselves call it
(oip_clients.py, in .venv-oip: they need protobuf<7), and httpx calls Triton's generate
extension and the REST errors."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from engine_pace import num_live_requests, restore_speed, slow_down
from envoy_support import tiny_engine_config
from gateway_support import RunningGateway, wait_serving

from llmrpc.cli.rest import IN_PROCESS_TARGET, gateway_settings
from llmrpc.gateway.app import route_paths
from llmrpc.gateway.settings import HttpSettings
from llmrpc.server.app import start_server
from llmrpc.server.settings import FrontendConfig

ROOT = Path(__file__).resolve().parents[2]
OIP_PYTHON = ROOT / ".venv-oip" / "bin" / "python"
KEY = "oip-key-0001"
MODEL = "tiny"
AUTH = {"authorization": f"Bearer {KEY}"}
GREEDY = {"max_tokens": 5, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def served(server_loop, tiny_llama_dir) -> Iterator[tuple]:
    """(running gRPC server, its REST gateway), wired as ``llmrpc serve`` wires them."""
    frontend = FrontendConfig(
        host="127.0.0.1", grpc_port=0, api_key=(KEY,),
        rest_http=HttpSettings(port=0, uvicorn_log_level="warning"),
    )  # fmt: skip
    config = tiny_engine_config(tiny_llama_dir)
    config = dataclasses.replace(
        config, model=dataclasses.replace(config.model, served_model_name=(MODEL,))
    )
    running = server_loop.run(start_server(config, frontend=frontend))
    gateway = RunningGateway(
        server_loop, gateway_settings(frontend), {IN_PROCESS_TARGET: running.loopback}
    )
    try:
        wait_serving(gateway)
        yield running, gateway
    finally:
        gateway.stop()
        server_loop.run(running.stop(grace=0))


@pytest.fixture(scope="module")
def clients_saw(served) -> dict:
    """What tritonclient and kserve saw, each scenario of oip_clients.py run once."""
    if not OIP_PYTHON.is_file():
        if os.environ.get("LLMRPC_REQUIRE_OIP_CLIENTS"):
            pytest.fail(f"{OIP_PYTHON} is missing: run `make oip-venv`")
        pytest.skip("no .venv-oip (make oip-venv): tritonclient and kserve are not installed")
    running, gateway = served
    config = {
        "grpc": f"127.0.0.1:{running.port}", "http": gateway.url.removeprefix("http://"),
        "model": MODEL, "key": KEY,
    }  # fmt: skip
    script = str(Path(__file__).with_name("oip_clients.py"))
    seen = {}
    # paced, so that a stream's tokens come a step apart: on a fast machine the tiny model's five
    # can all be ready before the first is sent, and go as one piece
    slow_down(running.engine, 0.01)
    try:
        for run in (["grpc", "http"], ["kserve"]):  # tritonclient and kserve: a process each
            arguments = [str(OIP_PYTHON), script, json.dumps({**config, "run": run})]
            done = subprocess.run(arguments, capture_output=True, text=True, timeout=240)
            assert done.returncode == 0, done.stderr[-3000:]
            seen |= json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        restore_speed(running.engine)
    return seen


def _reference(gateway, prompt: str = "Hello") -> str:
    """The same greedy completion over the OpenAI route."""
    body = {"model": MODEL, "prompt": prompt, **GREEDY}
    reply = httpx.post(gateway.url + "/v1/completions", json=body, headers=AUTH, timeout=60)
    return reply.json()["choices"][0]["text"]


def test_tritonclient_grpc_health_and_metadata(clients_saw):
    seen = clients_saw["grpc"]
    assert "crashed" not in seen, seen
    assert seen["live"] and seen["ready"] and seen["model_ready"]
    assert seen["server_name"] == "llmrpc" and "text_input" in seen["metadata_inputs"]


def test_tritonclient_grpc_text_in_text_out(clients_saw, served):
    assert clients_saw["grpc"]["text_output"] == "Hello" + _reference(served[1])


def test_tritonclient_grpc_stream(clients_saw, served):
    stream = clients_saw["grpc"]["stream"]
    assert stream["errors"] == [] and stream["final"]
    assert len(stream["pieces"]) >= 2
    assert "".join(stream["pieces"]) == _reference(served[1])


def test_tritonclient_grpc_errors(clients_saw):
    seen = clients_saw["grpc"]
    assert seen["bad_parameter"]["status"] == "StatusCode.INVALID_ARGUMENT"
    assert seen["bad_parameter"]["message"].startswith("temperature")
    assert seen["unknown_model"]["status"] == "StatusCode.NOT_FOUND"
    assert seen["no_key"]["status"] == "StatusCode.UNAUTHENTICATED"


def test_tritonclient_http(clients_saw, served):
    seen = clients_saw["http"]
    assert "crashed" not in seen, seen
    assert seen["live"] and seen["ready"] and seen["model_ready"]
    assert seen["metadata_name"] == MODEL
    expected = "Hello" + _reference(served[1])
    assert seen["text_output_binary"] == expected  # Triton's binary tensor extension
    assert seen["text_output_json"] == expected


def test_tritonclient_http_errors(clients_saw):
    seen = clients_saw["http"]
    assert seen["bad_parameter"]["status"] == "400" and "top_p" in seen["bad_parameter"]["message"]
    assert seen["unknown_model"]["status"] == "404"
    assert seen["no_key"]["status"] == "401"


def test_kserve_clients(clients_saw, served):
    seen = clients_saw["kserve"]
    assert "crashed" not in seen, seen
    expected = "Hello" + _reference(served[1])
    assert seen["grpc_ready"] is True
    assert seen["grpc_text_output"] == expected and seen["rest_text_output"] == expected


# --- Triton's generate extension and the REST routes, with httpx


def post(gateway, path: str, body, headers=AUTH, **kwargs) -> httpx.Response:
    return httpx.post(gateway.url + path, json=body, headers=headers, timeout=60, **kwargs)


def test_generate(served):
    _, gateway = served
    body = {"text_input": "Hello", "parameters": GREEDY, "exclude_input_in_output": True}
    reply = post(gateway, f"/v2/models/{MODEL}/generate", body)
    assert reply.status_code == 200, reply.text
    assert reply.json() == {
        "model_name": MODEL, "model_version": "1", "text_output": _reference(gateway)
    }  # fmt: skip


def test_generate_with_sampling_parameters_and_extra_outputs(served):
    _, gateway = served
    body = {
        "text_input": "Hello", "sampling_parameters": json.dumps(GREEDY),
        "return_finish_reason": True, "return_num_output_tokens": True,
    }  # fmt: skip
    answer = post(gateway, f"/v2/models/{MODEL}/generate", body).json()
    assert answer["text_output"] == "Hello" + _reference(gateway)
    assert answer["finish_reason"] == "length" and answer["num_output_tokens"] == 5


def test_generate_stream_sends_one_event_a_piece(served):
    running, gateway = served
    body = {"text_input": "Hello", "parameters": GREEDY}
    slow_down(running.engine, 0.01)  # tokens a step apart, as in clients_saw
    try:
        reply = post(gateway, f"/v2/models/{MODEL}/generate_stream", body)
    finally:
        restore_speed(running.engine)
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event")
    blocks = reply.text.split("\n\n")
    assert blocks[-1] == "" and all(block.startswith("data: ") for block in blocks[:-1])
    events = [json.loads(block.removeprefix("data: ")) for block in blocks[:-1]]
    assert len(events) >= 2 and all(e["model_name"] == MODEL for e in events)
    assert "".join(e["text_output"] for e in events) == _reference(gateway)


def test_rest_infer_json_tensors(served):
    _, gateway = served
    body = {
        "inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [2], "data": ["A", "B"]}],
        "parameters": {**GREEDY, "exclude_input_in_output": True},
        "outputs": [{"name": "text_output"}, {"name": "num_output_tokens"}],
    }
    answer = post(gateway, f"/v2/models/{MODEL}/infer", body).json()
    outputs = {o["name"]: o for o in answer["outputs"]}
    assert outputs["text_output"]["shape"] == [2] and len(outputs["text_output"]["data"]) == 2
    assert outputs["num_output_tokens"] == {
        "name": "num_output_tokens", "datatype": "UINT32", "shape": [2], "data": [5, 5]
    }  # fmt: skip


@pytest.mark.parametrize(
    ("path", "body", "status", "named"),
    [
        (
            "generate",
            {"text_input": "Hi", "parameters": {"temperature": "hot"}},
            400,
            "temperature",
        ),
        ("generate", {"text_input": "Hi", "parameters": {"max_tokens": -1}}, 400, "max_tokens"),
        ("generate", {"text_input": 7}, 400, "text_input"),
        ("generate_stream", {"text_input": "Hi", "parameters": {"top_k": 1.5}}, 400, "top_k"),
        ("infer", {"inputs": "nope"}, 400, "inputs"),
    ],
)
def test_rest_bad_input_is_a_400_naming_it(served, path, body, status, named):
    reply = post(served[1], f"/v2/models/{MODEL}/{path}", body)
    assert reply.status_code == status, reply.text
    assert named in reply.json()["error"]


@pytest.mark.parametrize("path", ["", "/ready"])
def test_rest_unknown_model_is_a_404(served, path):
    reply = httpx.get(served[1].url + f"/v2/models/no-such-model{path}", headers=AUTH)
    assert reply.status_code == 404 and "no-such-model" in reply.json()["error"]
    generate = post(served[1], "/v2/models/no-such-model/generate", {"text_input": "Hi"})
    assert generate.status_code == 404 and "no-such-model" in generate.json()["error"]


def test_rest_needs_the_key_but_probes_do_not(served):
    _, gateway = served
    body = {"text_input": "Hi", "parameters": {"max_tokens": 1}}
    assert post(gateway, f"/v2/models/{MODEL}/generate", body, headers={}).status_code == 401
    assert httpx.get(gateway.url + f"/v2/models/{MODEL}").status_code == 401
    assert httpx.get(gateway.url + "/v2/health/live").json() == {"live": True}
    assert httpx.get(gateway.url + "/v2/health/ready").json() == {"ready": True}
    ready = httpx.get(gateway.url + f"/v2/models/{MODEL}/ready", headers=AUTH)
    assert ready.json() == {"name": MODEL, "ready": True}


def test_a_client_leaving_the_stream_stops_its_request(served):
    running, gateway = served
    slow_down(running.engine, 0.02)
    try:
        body = {"text_input": "Hi", "parameters": {"max_tokens": 400, "ignore_eos": True}}
        url = gateway.url + f"/v2/models/{MODEL}/generate_stream"
        with httpx.stream("POST", url, json=body, headers=AUTH, timeout=60) as reply:
            # generation has begun; the iterator is kept: one dropped closes the connection
            # (httpx ends the stream when its line generator is collected)
            lines = reply.iter_lines()
            next(lines)
            assert num_live_requests(running.engine) == 1
        for _ in range(500):
            if num_live_requests(running.engine) == 0:
                break
            httpx.get(gateway.url + "/v2/health/live")  # a pause that waits on the server loop
        assert num_live_requests(running.engine) == 0
    finally:
        restore_speed(running.engine)


def test_envoy_routes_the_v2_paths_too():
    paths = set(route_paths())
    for path in ("/v2/health/ready", "/v2/models/{model}/infer", "/v2/models/{model}/generate"):
        assert path in paths


def _counters(gateway) -> dict[str, float]:
    """The gateway's request counters from /metrics: generation tokens, prompt tokens, requests
    finished by length, and the latency histogram's count."""
    text = httpx.get(gateway.url + "/metrics", timeout=30).text
    wanted = {
        "vllm:generation_tokens_total": "generated",
        "vllm:prompt_tokens_total": "prompt",
        "vllm:e2e_request_latency_seconds_count": "requests",
    }
    found = {"generated": 0.0, "prompt": 0.0, "requests": 0.0, "length": 0.0}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        base = name.split("{")[0]
        if base in wanted:
            found[wanted[base]] += float(value)
        elif base == "vllm:request_success_total" and 'finished_reason="length"' in name:
            found["length"] += float(value)
    return found


def test_rest_inferences_count_in_the_gateways_metrics(served):
    """Each /v2 inference counts as an OpenAI request does (tokens, finish reasons, latency),
    and its client gets only the outputs it asked for."""
    _, gateway = served
    before = _counters(gateway)
    generate = {"text_input": "Hello", "parameters": GREEDY}
    assert set(post(gateway, f"/v2/models/{MODEL}/generate", generate).json()) == {
        "model_name", "model_version", "text_output"
    }  # fmt: skip
    events = post(gateway, f"/v2/models/{MODEL}/generate_stream", generate).text.split("\n\n")
    assert all(set(json.loads(e.removeprefix("data: "))) == {"model_name", "model_version",
               "text_output"} for e in events[:-1])  # fmt: skip
    infer = {
        "inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [2], "data": ["A", "B"]}],
        "parameters": GREEDY,
        "outputs": [{"name": "text_output"}],
    }
    outputs = post(gateway, f"/v2/models/{MODEL}/infer", infer).json()["outputs"]
    assert [o["name"] for o in outputs] == ["text_output"]
    after = _counters(gateway)
    # 4 prompts of 5 tokens each: one generate, one stream, two in the infer
    assert after["generated"] - before["generated"] == 20
    assert after["length"] - before["length"] == 4
    assert after["requests"] - before["requests"] == 3  # one timing a call
    assert after["prompt"] > before["prompt"]
