"""TokenizationService: the server's tokenizer and chat template, over gRPC."""

from __future__ import annotations

import grpc
import pytest
from server_utils import field_violations

from llmrpc.v1 import common_pb2, tokenization_pb2

pytestmark = pytest.mark.asyncio(loop_scope="module")


async def test_tokenize_then_detokenize_round_trips(tokenization, server):
    text = "Hello, gRPC world! Ünïcode too."
    tokens = await tokenization.Tokenize(tokenization_pb2.TokenizeRequest(text=text))
    assert list(tokens.token_ids) == server.tokenization.tokenizer.encode(text)
    assert tokens.count == len(tokens.token_ids)
    assert len(tokens.token_strings) == tokens.count
    assert tokens.max_model_len == server.engine.model_info.max_model_len
    back = await tokenization.Detokenize(
        tokenization_pb2.DetokenizeRequest(token_ids=tokens.token_ids)
    )
    assert back.text == text


async def test_tokenize_chat_matches_the_rendered_template(tokenization, server):
    chat = common_pb2.Chat(messages=[common_pb2.ChatMessage(role="user", content="Hi")])
    tokens = await tokenization.Tokenize(tokenization_pb2.TokenizeRequest(chat=chat))
    tokenizer = server.tokenization.tokenizer
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert list(tokens.token_ids) == tokenizer.encode(rendered, add_special_tokens=False)


async def test_detokenize_keeps_special_tokens_when_asked(tokenization, server):
    eos = server.tokenization.tokenizer.eos_token_id
    request = tokenization_pb2.DetokenizeRequest(token_ids=[eos])
    assert (await tokenization.Detokenize(request)).text == ""
    request.skip_special_tokens = False
    assert (await tokenization.Detokenize(request)).text == server.tokenization.tokenizer.eos_token


async def test_detokenize_rejects_ids_outside_the_vocabulary(tokenization, server):
    vocab_size = server.engine.model_info.vocab_size
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        await tokenization.Detokenize(tokenization_pb2.DetokenizeRequest(token_ids=[vocab_size]))
    assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field_violations(failure.value) == ["token_ids"]


async def test_tokenize_unknown_model_is_not_found(tokenization):
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        await tokenization.Tokenize(tokenization_pb2.TokenizeRequest(model="nope", text="x"))
    assert failure.value.code() == grpc.StatusCode.NOT_FOUND


async def test_a_chat_template_without_a_tokenizer_is_refused_naming_the_flag():
    from llmrpc.server.tokenization import Tokenization

    with pytest.raises(ValueError, match="--chat-template needs a tokenizer"):
        Tokenization(None).set_chat_template("{{ messages }}")
