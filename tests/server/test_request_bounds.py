"""Over gRPC: non-finite numbers and oversized lists are INVALID_ARGUMENT naming the request's
own field; within the bounds, allowed tokens hold even at huge temperatures (issue 10, 6-7)."""

from __future__ import annotations

import math

import grpc
import pytest
from server_utils import field_violations

from llmrpc.engine import request as limits
from llmrpc.v1 import common_pb2, generation_pb2

pytestmark = pytest.mark.asyncio(loop_scope="module")

ALLOWED = [100, 200, 300]


def request(sampling=None, stopping=None) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        text="Hello there",
        sampling=common_pb2.SamplingParams(**(sampling or {})),
        stopping=common_pb2.StoppingCriteria(**{"max_tokens": 4, **(stopping or {})}),
    )


async def refused(generation, bad: generation_pb2.GenerateRequest) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        await generation.Generate(bad)
    assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    return failure.value


FLOAT_FIELDS = [
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
]


@pytest.mark.parametrize("name", FLOAT_FIELDS)
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
async def test_non_finite_sampling_numbers_name_their_field(generation, name, value):
    error = await refused(generation, request({name: value}))
    assert field_violations(error) == [f"sampling.{name}"]
    assert "must be a finite number" in error.details()


@pytest.mark.parametrize("bias", [math.nan, math.inf, -math.inf, 1e9])
async def test_logit_bias_must_be_finite_and_bounded(generation, bias):
    error = await refused(generation, request({"logit_bias": {5: bias}}))
    assert field_violations(error) == ["sampling.logit_bias"]


@pytest.mark.parametrize(
    ("sampling", "stopping", "field"),
    [
        ({}, {"stop": ["x"] * (limits.MAX_STOP_STRINGS + 1)}, "stopping.stop"),
        ({}, {"stop": ["x", "x" * (limits.MAX_STOP_STRING_CHARS + 1)]}, "stopping.stop[1]"),
        ({}, {"stop_token_ids": [1] * (limits.MAX_STOP_TOKEN_IDS + 1)}, "stopping.stop_token_ids"),
        ({"bad_words": ["x"] * (limits.MAX_BAD_WORDS + 1)}, {}, "sampling.bad_words"),
        ({"bad_words": ["x" * (limits.MAX_BAD_WORD_CHARS + 1)]}, {}, "sampling.bad_words[0]"),
        (
            {"logit_bias": dict.fromkeys(range(limits.MAX_LOGIT_BIAS + 1), 1.0)},
            {},
            "sampling.logit_bias",
        ),
        ({"allowed_token_ids": [1] * 10**5}, {}, "sampling.allowed_token_ids"),
        ({"n": limits.MAX_N + 1}, {}, "sampling.n"),
    ],
)
async def test_oversized_lists_name_their_field(generation, sampling, stopping, field):
    error = await refused(generation, request(sampling, stopping))
    assert field_violations(error) == [field]


@pytest.mark.parametrize("temperature", [1e30, 3e38])
async def test_huge_finite_temperature_keeps_to_the_allowed_tokens(generation, temperature):
    sampling = {"temperature": temperature, "allowed_token_ids": ALLOWED, "seed": 1}
    response = await generation.Generate(request(sampling, {"max_tokens": 12}))
    assert len(response.token_ids) == 12
    assert set(response.token_ids) <= set(ALLOWED)


async def test_allowed_tokens_biased_down_to_the_limit_are_still_the_only_ones(generation):
    sampling = {
        "temperature": 1.0,
        "allowed_token_ids": ALLOWED,
        "logit_bias": dict.fromkeys(ALLOWED, -limits.MAX_ABS_LOGIT_BIAS),
        "repetition_penalty": 3e38,
    }
    response = await generation.Generate(request(sampling, {"max_tokens": 12}))
    assert set(response.token_ids) <= set(ALLOWED)
