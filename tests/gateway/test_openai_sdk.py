"""The official OpenAI Python SDK, sync and async, against the real gateway in front of a real
gRPC replica of the tiny model: completions and chat, whole and streamed, and the gateway's
answers equal to the gRPC API's for the same request."""

from __future__ import annotations

import httpx
import openai
import pytest
from gateway_support import post, sse_data, sse_json

PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0.0, "max_tokens": 6, "extra_body": {"ignore_eos": True}}


def test_models_are_the_replicas(sdk, grpc_client):
    names = [card.id for card in grpc_client.models()]
    listed = sdk.models.list()
    assert [m.id for m in listed.data] == names
    assert sdk.models.retrieve(names[0]).id == names[0]
    with pytest.raises(openai.NotFoundError):
        sdk.models.retrieve("no-such-model")


def test_completion_equals_the_grpc_answer(sdk, grpc_client):
    direct = grpc_client.generate(PROMPT, temperature=0.0, max_tokens=6, ignore_eos=True)
    completion = sdk.completions.create(model="", prompt=PROMPT, **GREEDY)
    choice = completion.choices[0]
    assert choice.text == direct.text
    assert choice.finish_reason == "length"
    assert completion.usage.completion_tokens == 6
    assert completion.usage.prompt_tokens == direct.usage.prompt_tokens
    assert completion.id.startswith("cmpl-") and completion.object == "text_completion"


def test_prompt_forms_and_n_give_one_choice_per_sample(sdk, grpc_client):
    ids = grpc_client.tokenize(PROMPT).token_ids
    for prompt, num_prompts in ((PROMPT, 1), ([PROMPT, "Hello"], 2), (ids, 1), ([ids, ids], 2)):
        completion = sdk.completions.create(model="", prompt=prompt, n=2, seed=3, **GREEDY)
        assert [c.index for c in completion.choices] == list(range(2 * num_prompts))
        assert completion.usage.completion_tokens == 12 * num_prompts
    text = sdk.completions.create(model="", prompt=ids, **GREEDY).choices[0].text
    assert text == sdk.completions.create(model="", prompt=PROMPT, **GREEDY).choices[0].text


def test_echo_with_logprobs_covers_prompt_and_output(sdk, grpc_client):
    prompt_ids = grpc_client.tokenize(PROMPT).token_ids
    completion = sdk.completions.create(model="", prompt=PROMPT, echo=True, logprobs=2, **GREEDY)
    choice = completion.choices[0]
    assert choice.text.startswith(PROMPT) and len(choice.text) > len(PROMPT)
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(prompt_ids) + 6
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(lp <= 0 for lp in logprobs.token_logprobs[1:])
    assert logprobs.text_offset[:2] == [0, len(logprobs.tokens[0])]
    assert all(2 <= len(top) <= 3 for top in logprobs.top_logprobs[1:])  # top 2 + the chosen


def test_stop_string_ends_the_text(sdk):
    text = sdk.completions.create(model="", prompt=PROMPT, **GREEDY).choices[0].text
    stop = text.split()[1]  # a word the greedy answer reaches
    choice = sdk.completions.create(model="", prompt=PROMPT, stop=[stop], **GREEDY).choices[0]
    assert choice.finish_reason == "stop"
    assert choice.text == text[: text.index(stop)]
    assert choice.model_extra["stop_reason"] == stop


def test_seed_makes_sampling_repeatable_and_logit_bias_steers(sdk, grpc_client):
    sampled = {"model": "", "prompt": PROMPT, "max_tokens": 8, "temperature": 1.0}
    first = sdk.completions.create(**sampled, seed=11).choices[0].text
    assert sdk.completions.create(**sampled, seed=11).choices[0].text == first
    token_id = grpc_client.tokenize(" Paris", add_special_tokens=False).token_ids[0]
    biased = sdk.completions.create(
        model="", prompt=PROMPT, max_tokens=4, logit_bias={str(token_id): 100}
    )
    assert biased.choices[0].text == grpc_client.detokenize([token_id] * 4)


def test_streamed_completion_joins_to_the_whole_one(sdk):
    whole = sdk.completions.create(model="", prompt=PROMPT, **GREEDY)
    chunks = list(
        sdk.completions.create(
            model="", prompt=PROMPT, stream=True, stream_options={"include_usage": True}, **GREEDY
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert chunks[-2].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-2])


def test_streamed_samples_carry_their_index(sdk):
    stream = sdk.completions.create(
        model="", prompt=PROMPT, n=2, seed=5, temperature=1.0, max_tokens=5, stream=True
    )
    finished = {}
    for chunk in stream:
        (choice,) = chunk.choices
        assert choice.index not in finished, "a chunk after the sample's finish_reason"
        if choice.finish_reason is not None:
            finished[choice.index] = choice.finish_reason
    assert sorted(finished) == [0, 1]


def test_chat_equals_the_grpc_answer(sdk, grpc_client):
    direct = grpc_client.chat(MESSAGES, temperature=0.0, max_tokens=6, ignore_eos=True)
    completion = sdk.chat.completions.create(model="", messages=MESSAGES, **GREEDY)
    choice = completion.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == direct.text
    assert completion.usage.prompt_tokens == direct.usage.prompt_tokens
    parts = [{"role": "user", "content": [{"type": "text", "text": MESSAGES[0]["content"]}]}]
    from_parts = sdk.chat.completions.create(model="", messages=parts, **GREEDY)
    assert from_parts.choices[0].message.content == direct.text


def test_chat_logprobs_have_top_alternatives(sdk):
    completion = sdk.chat.completions.create(
        model="", messages=MESSAGES, logprobs=True, top_logprobs=3, **GREEDY
    )
    content = completion.choices[0].logprobs.content
    assert len(content) == 6
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy: the top
        assert bytes(entry.bytes).decode() == entry.token


async def test_async_chat_stream_role_first_and_finish_reason_last(gateway, sdk):
    whole = sdk.chat.completions.create(model="", messages=MESSAGES, **GREEDY)
    client = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    async with client:
        stream = await client.chat.completions.create(
            model="", messages=MESSAGES, stream=True, **GREEDY
        )
        chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:])
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == whole.choices[0].message.content


async def test_async_completion(gateway, sdk):
    whole = sdk.completions.create(model="", prompt=PROMPT, **GREEDY)
    client = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    async with client:
        completion = await client.completions.create(model="", prompt=PROMPT, **GREEDY)
    assert completion.choices[0].text == whole.choices[0].text


def test_sse_bytes_are_exactly_openais(gateway, slow_engine):
    # enough tokens, a step apart, to span several events (tokens that come faster than they are
    # read are sent together)
    body = {"prompt": PROMPT, "max_tokens": 32, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", gateway.url + "/v1/completions", json=body, timeout=60) as reply:
        assert reply.status_code == 200
        assert reply.headers["content-type"] == "text/event-stream; charset=utf-8"
        raw = reply.read()
    events = sse_json(raw)
    assert len(events) >= 2 and all(e["object"] == "text_completion" for e in events)
    assert len({e["id"] for e in events}) == 1
    chat = {"messages": MESSAGES, "max_tokens": 3, "stream": True, "n": 2}
    data = sse_data(post(gateway, "/v1/chat/completions", chat).content)
    assert data[-1] == "[DONE]"


def test_roles_render_through_the_template(gateway, grpc_client):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": []},
        {"role": "tool", "content": "sunny", "tool_call_id": "call-1"},
    ]
    reply = post(gateway, "/tokenize", {"messages": messages})
    assert reply.status_code == 200, reply.text
    text = grpc_client.detokenize(reply.json()["tokens"], skip_special_tokens=False)
    for role in ("system", "user", "assistant", "tool"):
        assert f"<|im_start|>{role}" in text
    assert text.endswith("<|im_start|>assistant\n")  # add_generation_prompt defaults to true


def test_tokenize_and_detokenize(gateway, grpc_client):
    reply = post(gateway, "/tokenize", {"prompt": PROMPT, "return_token_strs": True}).json()
    assert reply["tokens"] == grpc_client.tokenize(PROMPT).token_ids
    assert reply["count"] == len(reply["tokens"]) == len(reply["token_strs"])
    assert reply["max_model_len"] > 0
    assert post(gateway, "/detokenize", {"tokens": reply["tokens"]}).json() == {"prompt": PROMPT}


def test_health_and_version(gateway):
    assert httpx.get(gateway.url + "/health").status_code == 200
    version = httpx.get(gateway.url + "/version").json()["version"]
    assert version and version[0].isdigit()
