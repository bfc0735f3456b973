"""KServe v2 (``inference.GRPCInferenceService``) on the server's own port, called with the
stubs generated from our copy of the protocol: text in and out, parameters and their errors,
Triton's streaming extension, cancellation, reflection. tests/gateway/test_kserve_clients.py
drives the same service with tritonclient and kserve themselves."""

from __future__ import annotations

import json

import grpc
import pytest
import pytest_asyncio
from engine_pace import num_live_requests, restore_speed, slow_down
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from server_utils import field_violations, wait_until

from llmrpc.common.fanout import DEFAULT_MAX_PROMPTS_PER_REQUEST
from llmrpc.common.oip_bytes import join_elements, split_elements
from llmrpc.kserve import grpc_predict_v2_pb2 as pb
from llmrpc.kserve import grpc_predict_v2_pb2_grpc as pb_grpc
from llmrpc.v1 import generation_pb2

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def inference(channel) -> pb_grpc.GRPCInferenceServiceStub:
    return pb_grpc.GRPCInferenceServiceStub(channel)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def model(inference) -> str:
    metadata = await inference.ModelMetadata(pb.ModelMetadataRequest(name=""))
    return metadata.name


def text_request(model: str, *prompts: str, raw: bool = False, **parameters):
    request = pb.ModelInferRequest(model_name=model, id="req-1")
    tensor = request.inputs.add(name="text_input", datatype="BYTES", shape=[len(prompts)])
    if raw:  # as tritonclient sends it
        request.raw_input_contents.append(join_elements([p.encode() for p in prompts]))
    else:
        tensor.contents.bytes_contents.extend(p.encode() for p in prompts)
    for name, value in parameters.items():
        kind = {bool: "bool_param", int: "int64_param", float: "double_param", str: "string_param"}
        setattr(request.parameters[name], kind[type(value)], value)
    return request


def output_texts(response: pb.ModelInferResponse, name: str = "text_output") -> list[str]:
    index = [output.name for output in response.outputs].index(name)
    return [e.decode() for e in split_elements(response.raw_output_contents[index])]


async def test_live_ready_and_metadata(inference, model):
    assert (await inference.ServerLive(pb.ServerLiveRequest())).live
    assert (await inference.ServerReady(pb.ServerReadyRequest())).ready
    assert (await inference.ModelReady(pb.ModelReadyRequest(name=model))).ready
    assert not (await inference.ModelReady(pb.ModelReadyRequest(name="no-such-model"))).ready
    server = await inference.ServerMetadata(pb.ServerMetadataRequest())
    assert server.name == "llmrpc" and server.version
    metadata = await inference.ModelMetadata(pb.ModelMetadataRequest(name=model))
    assert metadata.versions == ["1"]
    assert ("text_input", "BYTES") in {(t.name, t.datatype) for t in metadata.inputs}
    assert ("text_output", "BYTES") in {(t.name, t.datatype) for t in metadata.outputs}


@pytest.mark.parametrize("raw", [False, True], ids=["contents", "raw"])
async def test_text_in_text_out_matches_v1_generate(inference, generation, model, raw):
    request = text_request(model, "Hello there", raw=raw, max_tokens=6, temperature=0.0)
    response = await inference.ModelInfer(request)
    assert response.model_name == model and response.id == "req-1"
    (text,) = output_texts(response)
    v1 = await generation.Generate(
        generation_pb2.GenerateRequest(
            text="Hello there", stopping={"max_tokens": 6}, sampling={"temperature": 0.0}
        )
    )
    assert text == "Hello there" + v1.text  # Triton's vLLM backend: the prompt comes first
    assert v1.usage.completion_tokens == 6


async def test_exclude_input_batch_and_extra_outputs(inference, model):
    request = text_request(
        model, "One", "Two three", max_tokens=3, ignore_eos=True, exclude_input_in_output=True,
        return_finish_reason=True, return_num_output_tokens=True,
    )  # fmt: skip
    response = await inference.ModelInfer(request)
    texts = output_texts(response)
    assert len(texts) == 2 and not any(t.startswith(("One", "Two three")) for t in texts)
    assert output_texts(response, "finish_reason") == ["length", "length"]
    (tokens,) = [o for o in response.outputs if o.name == "num_output_tokens"]
    assert tokens.datatype == "UINT32" and list(tokens.shape) == [2]


async def test_sampling_parameters_json_input_and_stop(inference, model):
    request = text_request(model, "Count: 1 2 3", exclude_input_in_output=True)
    parameters = request.inputs.add(name="sampling_parameters", datatype="BYTES", shape=[1])
    body = {"max_tokens": 4, "temperature": 0, "stop": ["zzz"], "ignore_eos": True}
    parameters.contents.bytes_contents.append(json.dumps(body).encode())
    request.outputs.add(name="num_output_tokens")
    response = await inference.ModelInfer(request)
    assert [o.name for o in response.outputs] == ["num_output_tokens"]
    assert response.raw_output_contents[0] == (4).to_bytes(4, "little")


@pytest.mark.parametrize(
    ("parameters", "field"),
    [
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": -1.0}, "temperature"),  # in range: the v1 API's check, renamed
        ({"max_tokens": -3}, "max_tokens"),
        ({"top_p": 1.5}, "top_p"),
        ({"tempreature": 0.5}, "tempreature"),
        ({"stream": True}, "stream"),  # ModelInfer answers once
        ({"timeout": 1000}, "timeout"),  # Triton's scheduling: not applied, so refused
        ({"sequence_id": 7}, "sequence_id"),
    ],
)
async def test_a_bad_parameter_is_invalid_argument_naming_it(inference, model, parameters, field):
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await inference.ModelInfer(text_request(model, "Hi", **parameters))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field_violations(caught.value) == [field]
    assert field in caught.value.details()


async def test_a_prompt_needs_text_input(inference, model):
    request = pb.ModelInferRequest(model_name=model)
    request.inputs.add(name="prompt", datatype="BYTES", shape=[1]).contents.bytes_contents.append(
        b"hi"
    )
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await inference.ModelInfer(request)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field_violations(caught.value) == ["prompt"]


async def test_an_unknown_model_is_not_found(inference):
    for call in (
        inference.ModelInfer(text_request("no-such-model", "Hi")),
        inference.ModelMetadata(pb.ModelMetadataRequest(name="no-such-model")),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND
        assert "no-such-model" in caught.value.details()


async def test_stream_sends_each_piece_then_a_final_one(inference, model):
    request = text_request(
        model, "Hello", max_tokens=5, ignore_eos=True, stream=True, temperature=0.0
    )
    pieces, finals = [], []
    async for message in inference.ModelStreamInfer(iter([request])):
        assert not message.error_message
        pieces += output_texts(message.infer_response)
        finals.append(message.infer_response.parameters["triton_final_response"].bool_param)
    assert finals[-1] and not any(finals[:-1])
    unary = await inference.ModelInfer(
        text_request(
            model,
            "Hello",
            max_tokens=5,
            ignore_eos=True,
            exclude_input_in_output=True,
            temperature=0.0,
        )
    )
    assert "".join(pieces) == output_texts(unary)[0]


async def test_stream_errors_are_per_request_and_the_stream_goes_on(inference, model):
    bad = text_request(model, "Hi", top_k="many", stream=True)
    bad.id = "bad-one"
    good = text_request(model, "Hi", max_tokens=2, stream=False)
    messages = [m async for m in inference.ModelStreamInfer(iter([bad, good]))]
    errors = [m for m in messages if m.error_message]
    assert len(errors) == 1 and errors[0].infer_response.id == "bad-one"
    assert errors[0].error_message.startswith("INVALID_ARGUMENT: top_k")
    assert [output_texts(m.infer_response) for m in messages if not m.error_message]


async def test_cancelling_the_stream_aborts_the_engine_request(server, inference, model):
    slow_down(server.engine, 0.02)
    try:
        request = text_request(model, "Hello", max_tokens=400, ignore_eos=True, stream=True)
        call = inference.ModelStreamInfer(iter([request]))
        await call.read()  # generation has begun
        assert num_live_requests(server.engine) == 1
        call.cancel()
        await wait_until(lambda: num_live_requests(server.engine) == 0, 5, "the abort")
    finally:
        restore_speed(server.engine)


async def test_reflection_lists_the_service(channel):
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    async for response in stub.ServerReflectionInfo(iter([request])):
        names = {s.name for s in response.list_services_response.service}
        break
    assert "inference.GRPCInferenceService" in names
    ask = reflection_pb2.ServerReflectionRequest(
        file_containing_symbol="inference.GRPCInferenceService"
    )
    async for response in stub.ServerReflectionInfo(iter([ask])):
        assert response.file_descriptor_response.file_descriptor_proto
        break


async def test_calls_run_side_by_side_on_one_stream(inference, model):
    requests = [text_request(model, f"Prompt {i}", max_tokens=3, stream=True) for i in range(3)]
    for index, request in enumerate(requests):
        request.id = f"r{index}"
    messages = [m async for m in inference.ModelStreamInfer(iter(requests))]
    finals = {
        m.infer_response.id
        for m in messages
        if m.infer_response.parameters["triton_final_response"].bool_param
    }
    assert finals == {"r0", "r1", "r2"}


async def test_more_prompts_than_a_request_may_hold_are_refused_on_both_calls(inference, model):
    """--max-prompts-per-request (its default here) bounds ModelInfer and each ModelStreamInfer
    request alike."""
    too_many = ["Hi"] * (DEFAULT_MAX_PROMPTS_PER_REQUEST + 1)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await inference.ModelInfer(text_request(model, *too_many, max_tokens=1))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field_violations(caught.value) == ["text_input"]
    request = text_request(model, *too_many, max_tokens=1)
    messages = [m async for m in inference.ModelStreamInfer(iter([request]))]
    assert [m.error_message.split(":")[:2] for m in messages] == [
        ["INVALID_ARGUMENT", " text_input"]
    ]
