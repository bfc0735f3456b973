"""Bodies of megabytes are parsed and validated in a process of the gateway's own, so the event
loop (REST health, and inside ``llmrpc serve`` the gRPC server too) keeps answering; a list
longer than the served model could use, or an object with more keys than any request needs, is
refused there, naming its parameter, and only a validated request comes back.

Each probe has a 1 s deadline (2 s for the probes of bodies of a million keys); parsing and
validating such a body on the loop's own process takes seconds here (a million unknown keys:
14 s).
"""

from __future__ import annotations

import json
import threading
import time

import grpc
import httpx
from gateway_support import post
from grpc_health.v1 import health_pb2, health_pb2_grpc

NUM_TOKEN_IDS = 1_500_000  # about 12 MiB of JSON


def probe_while(gateway, work, replica=None, deadline: float = 1.0) -> tuple[int, float, object]:
    """Run ``work()`` while probing ``/health``, and the replica's gRPC health over the network
    if given (``deadline`` seconds each): (probes, seconds, result)."""
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("value", work()))
    started = time.monotonic()
    thread.start()
    probes = 0
    channel = grpc.insecure_channel(replica.address) if replica is not None else None
    with httpx.Client(base_url=gateway.url, timeout=deadline) as client:
        while thread.is_alive():
            assert client.get("/health").status_code == 200
            if channel is not None:
                request = health_pb2.HealthCheckRequest()
                reply = health_pb2_grpc.HealthStub(channel).Check(request, timeout=deadline)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
            probes += 1
            time.sleep(0.05)
    thread.join()
    if channel is not None:
        channel.close()
    return probes, time.monotonic() - started, result["value"]


def post_raw(gateway, body: str) -> httpx.Response:
    headers = {"content-type": "application/json"}
    return httpx.post(gateway.url + "/v1/completions", content=body, headers=headers, timeout=120)


def test_a_million_unknown_keys_are_refused_while_health_answers(gateway, replica):
    keys = ", ".join(f'"k{i}": 0' for i in range(1_000_000))  # 11.9 MB
    body = '{"prompt": "Hello", ' + keys + "}"
    probes, seconds, reply = probe_while(gateway, lambda: post_raw(gateway, body), replica, 2.0)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] is None and "1000001 keys" in error["message"], error
    assert "at most 4096" in error["message"]


def test_a_megabyte_of_unknown_keys_under_the_parser_process_bound_is_refused_cheaply(gateway):
    # Parsed in the gateway's own process (under parser_process.OFF_PROCESS_BYTES): one 400
    # naming the bound, not an error per key (100,000 of them took 0.8 s of the GIL).
    keys = ", ".join(f'"k{i}": 0' for i in range(80_000))
    body = '{"prompt": "Hello", "max_tokens": 2, ' + keys + "}"
    assert len(body) < 2**20
    probes, seconds, reply = probe_while(gateway, lambda: post_raw(gateway, body), deadline=1.0)
    assert reply.status_code == 400, reply.text
    assert "80002 keys" in reply.json()["error"]["message"]


def test_a_million_logit_biases_are_refused_while_health_answers(gateway, replica):
    biases = ", ".join(f'"{i}": 1' for i in range(1_000_000))  # 11.9 MB
    body = '{"prompt": "Hello", "logit_bias": {' + biases + "}}"
    gateway.server_loop.run(gateway.state.max_list_items())  # asked once, before counting
    calls = replica.num_calls
    probes, seconds, reply = probe_while(gateway, lambda: post_raw(gateway, body), replica, 2.0)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "logit_bias", error
    assert error["message"] == "logit_bias: at most 1024 entries, got 1000000"
    assert replica.num_calls == calls  # refused by the gateway, never sent to the server


def test_a_huge_token_list_is_refused_while_health_answers(gateway):
    body = json.dumps({"prompt": list(range(1000, 1000 + NUM_TOKEN_IDS)), "max_tokens": 4})
    probes, seconds, reply = probe_while(
        gateway,
        lambda: httpx.post(
            gateway.url + "/v1/completions",
            content=body,
            headers={"content-type": "application/json"},
            timeout=120,
        ),
    )
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "prompt" and f"{NUM_TOKEN_IDS} items" in error["message"]
    assert probes >= seconds / 0.5


def test_large_bodies_parsed_elsewhere_are_served_or_refused_as_usual(gateway):
    # 1.2 MB of JSON whitespace around a small valid request: parsed in the parser process.
    padded = '{"prompt": "Hello", "max_tokens": 3' + " " * 1_200_000 + "}"
    headers = {"content-type": "application/json"}
    reply = httpx.post(gateway.url + "/v1/completions", content=padded, headers=headers, timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 3
    text = "word " * 400_000  # 2 MB of text: far past the context, refused by the server
    reply = post(gateway, "/v1/completions", {"prompt": text, "max_tokens": 2})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "prompt"
    nan = '{"prompt": "Hello", "temperature": NaN' + " " * 1_200_000 + "}"
    reply = httpx.post(gateway.url + "/v1/completions", content=nan, headers=headers, timeout=60)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "temperature"


def test_nesting_past_the_bound_is_refused_naming_the_parameter(gateway):
    deep = {"a": []}
    inner = deep["a"]
    for _ in range(100):  # far below Python's recursion limit, far above any schema's depth
        inner.append([])
        inner = inner[0]
    reply = post(gateway, "/v1/completions", {"prompt": "Hello", "kv_transfer_params": deep})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "kv_transfer_params"
    assert error["message"] == "kv_transfer_params is nested deeper than 64 levels"
