"""The responses a gateway keeps for ``previous_response_id`` and ``GET /v1/responses/{id}``.

In memory, per gateway process, bounded: the ``MAX_STORED_RESPONSES`` most recently stored or
used responses are kept, the least recently used one dropped first. A response made with
``store: false`` is never kept. Behind several gateways, a conversation continues on the
gateway that stored its previous response (sticky sessions), or it is not found.

Each entry holds the response object and the conversation up to and including its output as
chat messages, without the instructions (OpenAI does not carry them over to the next turn).
Entries share their messages with the entries before them (a list of references each), so a
long conversation costs its text once.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from fastapi import Request

from llmrpc.gateway.errors import OpenAIError

MAX_STORED_RESPONSES = 1024


@dataclass(frozen=True)
class StoredResponse:
    response: dict
    messages: tuple[dict, ...]  # the conversation, instructions left out


class ResponseStore:
    def __init__(self, capacity: int = MAX_STORED_RESPONSES) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: dict, messages: tuple[dict, ...]) -> None:
        self._entries[response["id"]] = StoredResponse(response, messages)
        self._entries.move_to_end(response["id"])
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        return self._entries.pop(response_id, None) is not None

    def previous(self, response_id: str) -> StoredResponse:
        """The entry ``previous_response_id`` names; OpenAI's 400 when there is none."""
        entry = self.get(response_id)
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
        store = state.responses_store = ResponseStore()
    return store
