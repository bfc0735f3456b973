"""Chat rendering's refusals read the same to a gRPC and a REST caller: they name the request's
``chat`` field and say what to do in terms both APIs share."""

from __future__ import annotations

import re

import pytest

from llmrpc.server.chat_render import render_chat
from llmrpc.server.errors import InvalidArgument
from llmrpc.v1 import common_pb2


def test_a_model_without_a_chat_template_says_what_to_do():
    chat = common_pb2.Chat(messages=[common_pb2.ChatMessage(role="user", content="Hi")])
    with pytest.raises(InvalidArgument) as refusal:
        render_chat(chat, tokenizer=None, has_chat_template=False)
    assert refusal.value.field == "chat"
    message = str(refusal.value)
    assert "--chat-template" in message, message
    # No gRPC field names a REST caller never sent.
    assert not re.search(r"\btext\b|token_ids", message.removeprefix("chat: ")), message
