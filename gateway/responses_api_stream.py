"""The server-sent events of a streamed response, in the order OpenAI sends them.

Each event is ``event: TYPE\\ndata: {json}\\n\\n``, its JSON carrying ``type`` and a
``sequence_number`` counting from 0; there is no ``[DONE]``. The stream opens with
``response.created`` and ``response.in_progress``; each output item is ``output_item.added``,
its part's ``content_part.added``, deltas (``output_text.delta``, ``reasoning_text.delta`` or
``function_call_arguments.delta``), their ``.done``, ``content_part.done`` and
``output_item.done``; the stream ends with ``response.completed``, ``response.incomplete`` (cut
short) or ``response.failed``, as the response's status says.

An item stays open while deltas of its kind come; a delta of another kind closes it and opens
the next one, so reasoning, text and calls may come in any order. A tool call arrives whole
(the server parses it at its end), so its arguments are one delta.
"""

from __future__ import annotations

from llmrpc.clients import FinishReason, ToolCall
from llmrpc.gateway import responses_api_output as out
from llmrpc.gateway.errors import OpenAIError
from llmrpc.gateway.sse import dumps

# The event ending a stream, by the response's final status.
_LAST_EVENTS = {
    "completed": "response.completed",
    "incomplete": "response.incomplete",
    "failed": "response.failed",
}


class _OpenItem:
    """The output item being streamed: its place, id, kind and text so far."""

    def __init__(self, index: int, kind: str) -> None:
        self.index = index
        self.kind = kind  # "message" or "reasoning"
        self.id = out.new_id("msg" if kind == "message" else "rs")
        self.texts: list[str] = []

    @property
    def text(self) -> str:
        return "".join(self.texts)

    def where(self) -> dict:
        return {"item_id": self.id, "output_index": self.index, "content_index": 0}

    def item(self, text: str | None, status: str) -> dict:
        if self.kind == "message":
            return out.message_item(self.id, text, status)
        return out.reasoning_item(self.id, text, status)

    def part(self, text: str) -> dict:
        return out.text_part(text) if self.kind == "message" else out.reasoning_part(text)


class ResponseEvents:
    """Writes one response's events and collects its output items."""

    def __init__(self, envelope: dict) -> None:
        self.envelope = envelope
        self.output: list[dict] = []
        self._open: _OpenItem | None = None
        self._sequence = 0
        self.response: dict | None = None  # the response as it ended, once it has

    def event(self, kind: str, **fields) -> bytes:
        body = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return f"event: {kind}\ndata: {dumps(body)}\n\n".encode()

    def start(self) -> list[bytes]:
        return [
            self.event("response.created", response=self.envelope),
            self.event("response.in_progress", response=self.envelope),
        ]

    def text(self, delta: str, kind: str) -> list[bytes]:
        """A text delta of the message (``kind`` "message") or of the reasoning."""
        events = []
        if self._open is None or self._open.kind != kind:
            events.extend(self.close())
            events.extend(self._add(kind))
        item = self._open
        item.texts.append(delta)
        name = (
            "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        )
        extra = {"logprobs": []} if kind == "message" else {}
        events.append(self.event(name, **item.where(), delta=delta, **extra))
        return events

    def _add(self, kind: str) -> list[bytes]:
        item = self._open = _OpenItem(len(self.output), kind)
        return [
            self.event(
                "response.output_item.added",
                output_index=item.index,
                item=item.item(None, "in_progress"),
            ),
            self.event("response.content_part.added", **item.where(), part=item.part("")),
        ]

    def close(self, status: str = "completed") -> list[bytes]:
        """Finish the open item, if any."""
        item, self._open = self._open, None
        if item is None:
            return []
        text = item.text
        if item.kind == "message":
            done = self.event("response.output_text.done", **item.where(), text=text, logprobs=[])
        else:
            done = self.event("response.reasoning_text.done", **item.where(), text=text)
        whole = item.item(text, status)
        self.output.append(whole)
        return [
            done,
            self.event("response.content_part.done", **item.where(), part=item.part(text)),
            self.event("response.output_item.done", output_index=item.index, item=whole),
        ]

    def tool_call(self, call: ToolCall) -> list[bytes]:
        events = self.close()
        index, item_id = len(self.output), out.new_id("fc")
        where = {"item_id": item_id, "output_index": index}
        whole = out.function_call_item(item_id, call, call.arguments, "completed")
        self.output.append(whole)
        return [
            *events,
            self.event(
                "response.output_item.added",
                output_index=index,
                item=out.function_call_item(item_id, call, "", "in_progress"),
            ),
            self.event("response.function_call_arguments.delta", **where, delta=call.arguments),
            self.event(
                "response.function_call_arguments.done",
                **where,
                name=call.name,
                arguments=call.arguments,
            ),
            self.event("response.output_item.done", output_index=index, item=whole),
        ]

    def finish(self, reason: FinishReason | None, usage: dict) -> list[bytes]:
        """The last events: the open item closed, then the response as it ended (kept in
        ``response``)."""
        status = out.outcome(reason)[0]
        events = []
        if not self.output and self._open is None:
            events = self._add("message")  # OpenAI always answers with a message, if empty
        events.extend(self.close(out.item_status(status)))
        self.response = out.finished(self.envelope, reason, self.output, usage)
        events.append(self.event(_LAST_EVENTS[status], response=self.response))
        return events

    def error(self, error: OpenAIError) -> bytes:
        """An error after the stream began. The fields at the top are OpenAI's error event;
        ``error`` beside them is what makes the OpenAI SDK raise it, as for chat streams."""
        body = error.body()["error"]
        return self.event(
            "error", code=body["code"], message=body["message"], param=body["param"], error=body
        )
