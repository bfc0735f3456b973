"""Bodies of megabytes are parsed in a process of the gateway's own, so the event loop (REST
health, and inside ``llmrpc serve`` the gRPC server too) keeps answering; a list longer than the
served model could use is refused there, naming its parameter, without being sent back.

Each probe has a 1 s deadline; parsing and validating such a body on the loop's own process
takes seconds here.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
from gateway_support import post

NUM_TOKEN_IDS = 1_500_000  # about 12 MiB of JSON


def probe_while(gateway, work) -> tuple[int, float, object]:
    """Run ``work()`` while probing ``/health`` (1 s deadline each): (probes, seconds, result)."""
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("value", work()))
    started = time.monotonic()
    thread.start()
    probes = 0
    with httpx.Client(base_url=gateway.url, timeout=1.0) as client:
        while thread.is_alive():
            assert client.get("/health").status_code == 200
            probes += 1
            time.sleep(0.05)
    thread.join()
    return probes, time.monotonic() - started, result["value"]


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
