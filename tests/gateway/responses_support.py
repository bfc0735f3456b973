"""Reading ``/v1/responses`` streams as the OpenAI SDK's typed events."""

from __future__ import annotations

import json
import typing

from openai.types.responses import ResponseStreamEvent

# The SDK's event classes by type: each event is validated against its class in full (the
# SDK itself only constructs them, so a missing field would surface later, in a user's code).
EVENT_CLASSES = {
    typing.get_args(cls.model_fields["type"].annotation)[0]: cls
    for cls in typing.get_args(typing.get_args(ResponseStreamEvent)[0])
}


def sse_events(text: str) -> list:
    """The SDK's events from a Responses stream, checking the framing on the way:
    ``event: TYPE`` then ``data: JSON`` with that type, no ``[DONE]``."""
    blocks = text.split("\n\n")
    assert blocks[-1] == "" and "[DONE]" not in text
    events = []
    for block in blocks[:-1]:
        event_line, data_line = block.split("\n")
        data = json.loads(data_line.removeprefix("data: "))
        assert event_line == f"event: {data['type']}"
        events.append(EVENT_CLASSES[data["type"]].model_validate(data))
    return events
