"""The responses a gateway keeps for ``previous_response_id`` and ``GET /v1/responses/{id}``.

In memory, per gateway process, bounded by bytes (``--responses-store-max-bytes``): past the
bound the least recently stored or used responses are dropped first; a response larger than
the whole bound is not kept. A response made with ``store: false`` is never kept. Behind several
gateways, a conversation continues on the gateway that stored its previous response (sticky
sessions), or it is not found.

Each entry holds what the response needs, not the request: the response's JSON (what ``GET``
answers, encoded once) and the conversation up to and including its output as chat messages,
without the instructions (OpenAI does not carry them over to the next turn). Entries share their
messages with the entries before them (a list of references each), so a long conversation costs
its text once; each entry is charged all the objects of its conversation all the same, so what
the store counts is never less than what it holds.

Each entry belongs to the API key that made it: it is found by (owner, id), the owner being the
SHA-256 digest of the caller's key (``middleware.caller_key_digest``; None on a gateway without
keys), never the key. Another key's response is not found, exactly as an unknown id is; the same
id under two keys is two entries, neither replacing nor revealing the other.
"""

from __future__ import annotations

import json
import logging
import sys
from collections import OrderedDict
from dataclasses import dataclass

from fastapi import Request

from llmrpc.gateway.errors import OpenAIError
from llmrpc.gateway.settings import DEFAULT_RESPONSES_STORE_MAX_BYTES
from llmrpc.gateway.sse import dumps

logger = logging.getLogger(__name__)

# What an entry costs beside its JSON and messages: the entry, its key, its owner's digest and
# its place in the ordered dict (340 to 550 bytes measured on CPython 3.11), rounded up.
ENTRY_OVERHEAD_BYTES = 1024


@dataclass(frozen=True, slots=True)
class StoredResponse:
    body: bytes  # the response's JSON
    messages: tuple[dict, ...]  # the conversation, instructions left out
    nbytes: int  # what the store charges for it

    @property
    def response(self) -> dict:
        return json.loads(self.body)


def _size(root) -> int:
    """The bytes of ``root``'s objects (dicts, lists, tuples, strings, numbers): each reference
    counted, so a shared object is counted as often as it is referred to. Iterative."""
    total, stack = 0, [root]
    while stack:
        value = stack.pop()
        total += sys.getsizeof(value)
        if isinstance(value, dict):
            stack.extend(value.keys())
            stack.extend(value.values())
        elif isinstance(value, list | tuple):
            stack.extend(value)
    return total


class ResponseStore:
    def __init__(self, max_bytes: int = DEFAULT_RESPONSES_STORE_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0  # what the entries are charged, together
        self._entries: OrderedDict[tuple[bytes | None, str], StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: dict, messages: tuple[dict, ...], owner: bytes | None = None) -> None:
        body = dumps(response).encode()
        nbytes = ENTRY_OVERHEAD_BYTES + sys.getsizeof(body) + _size(messages)
        key = (owner, response["id"])
        self._drop(key)
        if nbytes > self.max_bytes:
            if self.max_bytes:  # 0: the store is off, and says so once (``store_of``)
                logger.info(
                    "response %s not stored: %d bytes, over --responses-store-max-bytes %d",
                    response["id"], nbytes, self.max_bytes,
                )  # fmt: skip
            return
        self._entries[key] = StoredResponse(body, messages, nbytes)
        self.nbytes += nbytes
        while self.nbytes > self.max_bytes:
            self.nbytes -= self._entries.popitem(last=False)[1].nbytes

    def _drop(self, key: tuple[bytes | None, str]) -> bool:
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        self.nbytes -= entry.nbytes
        return True

    def get(self, response_id: str, owner: bytes | None = None) -> StoredResponse | None:
        key = (owner, response_id)
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def delete(self, response_id: str, owner: bytes | None = None) -> bool:
        return self._drop((owner, response_id))

    def previous(self, response_id: str, owner: bytes | None = None) -> StoredResponse:
        """The entry ``previous_response_id`` names; OpenAI's 400 when there is none."""
        entry = self.get(response_id, owner)
        if entry is None:
            raise OpenAIError(
                400,
                f"Previous response with id '{response_id}' not found.",
                "previous_response_id",
                "previous_response_not_found",
            )
        return entry


def store_of(request: Request) -> ResponseStore:
    """The app's store, made on first use (the app's other state knows nothing of it)."""
    state = request.app.state
    store = getattr(state, "responses_store", None)
    if store is None:
        max_bytes = state.gateway.api.responses_store_max_bytes
        if not max_bytes:
            logger.info("--responses-store-max-bytes 0: no response is stored")
        store = state.responses_store = ResponseStore(max_bytes)
    return store
