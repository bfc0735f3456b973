"""Every sampling and output option through the gRPC API: n samples, logprobs, penalties..."""

from __future__ import annotations

import grpc
import pytest
from server_utils import field_violations

from llmrpc.engine.request import FinishReason, RequestOutput, SamplingParams
from llmrpc.server import convert
from llmrpc.server.errors import DeadlineExceeded
from llmrpc.v1 import admin_pb2, common_pb2, generation_pb2

pytestmark = pytest.mark.asyncio(loop_scope="module")


def request(max_tokens=8, sampling=None, output=None, **fields) -> generation_pb2.GenerateRequest:
    fields.setdefault("text", "Once upon a time")
    return generation_pb2.GenerateRequest(
        sampling=sampling or common_pb2.SamplingParams(temperature=0.0),
        stopping=common_pb2.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True),
        output=output,
        **fields,
    )


async def test_unary_n_samples_are_listed_with_their_index_and_summed_usage(generation):
    sampling = common_pb2.SamplingParams(temperature=1.0, seed=5, n=3)
    response = await generation.Generate(request(6, sampling))
    assert [s.index for s in response.samples] == [0, 1, 2]
    assert len({tuple(s.token_ids) for s in response.samples}) == 3
    assert response.text == response.samples[0].text  # the top level describes sample 0
    assert response.usage.completion_tokens == 18
    assert all(s.finish_reason == generation_pb2.FINISH_REASON_LENGTH for s in response.samples)


async def test_streamed_n_samples_carry_their_index_and_match_unary(generation):
    sampling = common_pb2.SamplingParams(temperature=1.0, seed=5, n=3)
    unary = await generation.Generate(request(6, sampling))
    texts = {0: "", 1: "", 2: ""}
    messages = [m async for m in generation.GenerateStream(request(6, sampling))]
    for message in messages:
        texts[message.index] += message.text
    assert texts == {s.index: s.text for s in unary.samples}
    assert [m.usage.completion_tokens for m in messages if m.HasField("usage")] == [18]
    assert messages[-1].HasField("usage")


async def test_logprobs_and_prompt_logprobs_come_with_token_text(generation, server):
    output = common_pb2.OutputOptions(logprobs=3, prompt_logprobs=2)
    response = await generation.Generate(request(5, output=output))
    prompt = server.tokenization.tokenizer.encode("Once upon a time")
    assert len(response.logprobs) == 5
    for entry, token_id in zip(response.logprobs, response.token_ids, strict=True):
        assert entry.token_id == token_id and entry.rank == 1  # greedy
        assert entry.token == server.tokenization.tokenizer.decode([token_id])
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token_id == token_id
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
    assert [e.token_id for e in response.prompt_logprobs] == prompt[1:]
    assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in response.prompt_logprobs)


async def test_penalties_bias_and_allowed_tokens_steer_the_output(generation):
    plain = await generation.Generate(request(8))
    allowed = [plain.token_ids[0] + 1, plain.token_ids[0] + 2]
    sampling = common_pb2.SamplingParams(temperature=0.0, allowed_token_ids=allowed)
    response = await generation.Generate(request(8, sampling))
    assert set(response.token_ids) <= set(allowed)
    biased = common_pb2.SamplingParams(temperature=0.0, logit_bias={42: 100.0})
    assert list((await generation.Generate(request(4, biased))).token_ids) == [42] * 4
    # Once generated, token 42's biased logit (about 100) is divided by the repetition penalty
    # and falls below the best other token: the penalty reaches the engine after the bias.
    penalised = common_pb2.SamplingParams(
        temperature=0.0, logit_bias={42: 100.0}, repetition_penalty=1000.0
    )
    tokens = list((await generation.Generate(request(4, penalised))).token_ids)
    assert tokens[0] == 42 and 42 not in tokens[1:]


@pytest.mark.parametrize(
    ("sampling", "output", "field"),
    [
        ({"presence_penalty": 3.0}, {}, "sampling.presence_penalty"),
        ({"repetition_penalty": 0.0}, {}, "sampling.repetition_penalty"),
        ({"n": 0}, {}, "sampling.n"),
        ({"logit_bias": {10**6: 1.0}}, {}, "sampling.logit_bias"),
        ({"allowed_token_ids": [10**6]}, {}, "sampling.allowed_token_ids"),
        ({}, {"logprobs": 21}, "output.logprobs"),
    ],
)
async def test_bad_options_name_their_field(generation, sampling, output, field):
    bad = request(
        4,
        common_pb2.SamplingParams(temperature=0.0, **sampling),
        common_pb2.OutputOptions(**output),
    )
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        await generation.Generate(bad)
    assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field_violations(failure.value) == [field]


async def test_truncation_keeps_the_end_of_the_prompt(generation):
    response = await generation.Generate(request(2, truncate_prompt_tokens=2))
    assert response.usage.prompt_tokens == 2


async def test_model_info_publishes_the_defaults_a_request_gets(admin):
    info = await admin.GetModelInfo(admin_pb2.GetModelInfoRequest())
    assert info.default_sampling.temperature == 1.0
    assert info.default_sampling.n == 1
    assert info.default_sampling.repetition_penalty == 1.0
    assert info.default_stopping.max_tokens == 16


async def test_a_dropped_request_becomes_deadline_exceeded():
    accumulator = convert.OutputAccumulator("r", SamplingParams(), tokenizer=None)
    dropped = RequestOutput("r", "", [], finished=True, finish_reason=FinishReason.DEADLINE)
    with pytest.raises(DeadlineExceeded), convert.engine_errors(generation_pb2.GenerateRequest()):
        accumulator.add(dropped)
