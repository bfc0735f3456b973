"""The Responses store under attack, against the real gateway in front of a real gRPC replica of
the tiny model: it is bounded by bytes (oldest dropped first) and charges each entry at least
what it really holds; it keeps the response's JSON, not the request's objects; a stored response
belongs to the key that made it (another key gets the 404 of an unknown id); and what a request
may send that the model may never see (tools) has bounds, on /v1/responses and
/v1/chat/completions alike."""

from __future__ import annotations

import gc
import sys
import types
from collections.abc import Iterator

import httpx
import pytest
from envoy_support import Replica, ServerLoop
from gateway_support import RunningGateway, running_gateway

from llmrpc import cli
from llmrpc.cli.rest import gateway_settings
from llmrpc.gateway import cli as gateway_cli
from llmrpc.gateway.middleware import key_digest
from llmrpc.gateway.responses_api_store import ResponseStore
from llmrpc.gateway.settings import ApiSettings
from llmrpc.server import options

GREEDY = {"model": "", "temperature": 0.0, "max_output_tokens": 2, "tool_choice": "none"}
K1, K2 = "key-one-0001", "key-two-0002"
STORE_LIMIT = 200_000
# The documented bounds on a tool (docs/api.md, Tool calling): what a chat template may never
# show.
DESCRIPTION_CHARS = 16_384
PARAMETERS_CHARS = 65_536
TOOLS_CHARS = 1_048_576
MIB = 2**20


@pytest.fixture(scope="module")
def small_store(server_loop: ServerLoop, replica: Replica) -> Iterator[RunningGateway]:
    """A gateway whose store keeps at most ``STORE_LIMIT`` bytes."""
    api = {"responses_store_max_bytes": STORE_LIMIT}
    with running_gateway(server_loop, [replica.address], api=api) as gateway:
        yield gateway


@pytest.fixture(scope="module")
def plain(server_loop: ServerLoop, replica: Replica) -> Iterator[RunningGateway]:
    with running_gateway(server_loop, [replica.address]) as gateway:
        yield gateway


@pytest.fixture(scope="module")
def keyed(server_loop: ServerLoop, replica: Replica) -> Iterator[RunningGateway]:
    """A gateway taking two keys (``--api-key k1 k2``)."""
    with running_gateway(server_loop, [replica.address], api={"api_keys": (K1, K2)}) as gateway:
        yield gateway


def tool(index: int, description: str = "", parameters: dict | None = None) -> dict:
    spec = {"type": "function", "name": f"tool_{index}", "description": description}
    return {**spec, "parameters": parameters or {"type": "object"}}


def create(gateway: RunningGateway, key: str | None = None, **body) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    body = {"input": "Hi", **GREEDY, **body}
    return httpx.post(gateway.url + "/v1/responses", json=body, headers=headers, timeout=120)


def call(gateway: RunningGateway, method: str, response_id: str, key: str) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"}
    url = f"{gateway.url}/v1/responses/{response_id}"
    return httpx.request(method, url, headers=headers, timeout=60)


def deep_size(root) -> int:
    """The bytes of ``root`` and of everything it reaches, each object once (types, modules and
    functions left out)."""
    seen, stack, total = set(), [root], 0
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, type | types.ModuleType | types.FunctionType):
            continue
        seen.add(id(obj))
        total += sys.getsizeof(obj)
        stack.extend(gc.get_referents(obj))
    return total


def store_of(gateway: RunningGateway) -> ResponseStore:
    return gateway.app.state.responses_store


# --- bytes ------------------------------------------------------------------------------------


def test_the_store_is_bounded_by_bytes_oldest_dropped_first(small_store):
    tools = [tool(i, "d" * 8_000) for i in range(4)]  # about 32 KB a response
    ids = []
    for _ in range(12):
        reply = create(small_store, tools=tools)
        assert reply.status_code == 200, reply.text
        ids.append(reply.json()["id"])
    store = store_of(small_store)
    assert 0 < store.nbytes <= STORE_LIMIT
    assert deep_size(store._entries) <= store.nbytes  # the accounting undercounts nothing
    kept = [i for i in ids if call(small_store, "GET", i, "unused").status_code == 200]
    assert 3 <= len(kept) < len(ids) and kept == ids[-len(kept) :]  # the newest, in order


def test_a_stored_response_is_charged_its_json_not_the_requests_objects(small_store):
    # A schema of many small objects: its JSON is small, its Python objects are not.
    properties = {f"p{i}": {"type": "string"} for i in range(1_500)}
    schema = {"type": "object", "properties": properties}
    reply = create(small_store, tools=[tool(0, "x", schema)])
    assert reply.status_code == 200, reply.text
    store = store_of(small_store)
    entry = store.get(reply.json()["id"])
    got = call(small_store, "GET", reply.json()["id"], "unused")
    assert got.json() == reply.json()
    assert deep_size(entry) <= entry.nbytes <= 2 * len(got.content)


def test_a_response_larger_than_the_store_is_not_kept():
    store = ResponseStore(max_bytes=4_000)
    store.put({"id": "small"}, ())
    store.put({"id": "big", "text": "x" * 10_000}, ())
    assert store.get("big") is None and store.get("small") is not None
    assert store.nbytes <= 4_000
    off = ResponseStore(max_bytes=0)  # --responses-store-max-bytes 0
    off.put({"id": "small"}, ())
    assert off.get("small") is None and off.nbytes == 0


def test_the_store_keeps_the_most_recently_used():
    store = ResponseStore(max_bytes=10**6)
    store.put({"id": "a"}, ())
    per_entry = store.nbytes
    store = ResponseStore(max_bytes=2 * per_entry)
    for name in ("a", "b"):
        store.put({"id": name}, ())
    assert store.get("a") is not None  # now the most recently used
    store.put({"id": "c"}, ())
    assert store.get("b") is None and store.get("a") and store.get("c") and len(store) == 2


# --- keys -------------------------------------------------------------------------------------


def _without(body: dict, response_id: str) -> dict:
    """An error body with the id it names blanked out."""
    error = body["error"]
    return {**error, "message": error["message"].replace(response_id, "ID")}


def test_a_stored_response_belongs_to_the_key_that_made_it(keyed):
    mine = create(keyed, K1).json()
    unknown = "resp_" + "0" * 32
    for method in ("GET", "DELETE"):
        theirs, none = call(keyed, method, mine["id"], K2), call(keyed, method, unknown, K2)
        assert theirs.status_code == none.status_code == 404
        assert _without(theirs.json(), mine["id"]) == _without(none.json(), unknown)
    theirs = create(keyed, K2, previous_response_id=mine["id"])
    none = create(keyed, K2, previous_response_id=unknown)
    assert theirs.status_code == none.status_code == 400
    assert _without(theirs.json(), mine["id"]) == _without(none.json(), unknown)
    # Untouched by the other key: still the owner's to read, continue and delete.
    assert call(keyed, "GET", mine["id"], K1).json() == mine
    assert create(keyed, K1, previous_response_id=mine["id"]).status_code == 200
    assert call(keyed, "DELETE", mine["id"], K1).status_code == 200
    assert call(keyed, "GET", mine["id"], K1).status_code == 404


def test_the_store_keeps_the_keys_digest_never_the_key(keyed):
    create(keyed, K1)
    store = store_of(keyed)
    assert K1 not in repr(store._entries) and K1.encode() not in repr(store._entries).encode()
    assert {owner for owner, _ in store._entries} == {key_digest(K1)}


def test_the_same_id_under_two_keys_is_two_responses():
    store = ResponseStore(max_bytes=10**6)
    alice, bob = key_digest(K1), key_digest(K2)
    store.put({"id": "resp_1", "who": "alice"}, (), alice)
    assert store.get("resp_1", bob) is None and not store.delete("resp_1", bob)
    store.put({"id": "resp_1", "who": "bob"}, (), bob)  # neither replaces nor reveals alice's
    assert store.get("resp_1", alice).response["who"] == "alice"
    assert store.get("resp_1", bob).response["who"] == "bob"
    assert store.delete("resp_1", bob) and store.get("resp_1", alice) is not None


# --- tools ------------------------------------------------------------------------------------


def _param(reply: httpx.Response) -> str:
    assert reply.status_code == 400, reply.text[:300]
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] in error["message"]
    return error["param"]


def _chat(gateway: RunningGateway, tools: list[dict]) -> httpx.Response:
    functions = [{k: v for k, v in t.items() if k != "type"} for t in tools]
    chat_tools = [{"type": "function", "function": function} for function in functions]
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    body.update(tools=chat_tools, tool_choice="none")
    return httpx.post(gateway.url + "/v1/chat/completions", json=body, timeout=120)


def _schema(chars: int) -> dict:
    """An object schema whose JSON text is about ``chars`` characters."""
    return {"type": "object", "description": "s" * chars}


@pytest.mark.parametrize(
    ("tools", "responses_param", "chat_param"),
    [
        (
            [tool(i) for i in range(3)] + [tool(3, "d" * (DESCRIPTION_CHARS + 1))],
            "tools[3].description",
            "tools[3].function.description",
        ),
        (
            [tool(0), tool(1, parameters=_schema(PARAMETERS_CHARS))],
            "tools[1].parameters",
            "tools[1].function.parameters",
        ),
        (  # each tool within its bounds, all of them together not
            [tool(i, "d" * DESCRIPTION_CHARS) for i in range(TOOLS_CHARS // DESCRIPTION_CHARS)]
            + [tool(99, "d")],
            "tools",
            "tools",
        ),
        ([tool(i) for i in range(129)], "tools", "tools"),
    ],
    ids=["description", "parameters", "all-tools", "count"],
)
def test_tools_beyond_their_bounds_are_400s_naming_them(plain, tools, responses_param, chat_param):
    assert _param(create(plain, tools=tools)) == responses_param
    assert _param(_chat(plain, tools)) == chat_param


def test_the_attack_of_128_tools_of_85_kb_is_refused_and_keeps_nothing(plain):
    assert create(plain).status_code == 200  # the store exists
    before = len(store_of(plain))
    tools = [tool(i, "d" * 85_000) for i in range(128)]
    assert _param(create(plain, tools=tools)) == "tools[0].description"
    assert len(store_of(plain)) == before


def test_tools_at_their_bounds_are_accepted(plain):
    tools = [tool(0, "d" * DESCRIPTION_CHARS, _schema(PARAMETERS_CHARS - 1_000))]
    assert create(plain, tools=tools).status_code == 200
    assert _chat(plain, tools).status_code == 200


# --- flags ------------------------------------------------------------------------------------


def _serve_api(*argv: str):
    parser = cli.build_parser()[1]
    _, frontend = options.build_configs(options.parse_serve_values(parser, ["m", *argv]))
    return gateway_settings(frontend).api


def test_the_store_size_flag_of_serve_and_gateway():
    assert _serve_api().responses_store_max_bytes == 256 * MIB
    assert _serve_api("--responses-store-max-bytes", "8M").responses_store_max_bytes == 8 * MIB
    assert _serve_api("--responses-store-max-bytes", "0").responses_store_max_bytes == 0
    with pytest.raises(ValueError, match="--responses-store-max-bytes"):
        ApiSettings(responses_store_max_bytes=-1)
    parser = gateway_cli.build_parser()
    args = parser.parse_args(["--backend", "x:1"])
    assert gateway_cli.settings_from_args(args).api.responses_store_max_bytes == 256 * MIB
    args = parser.parse_args(["--backend", "x:1", "--responses-store-max-bytes", "1024"])
    assert gateway_cli.settings_from_args(args).api.responses_store_max_bytes == 1024
