"""ModelInferRequest tensors and parameters as Python values, and ModelInferResponses made.

Each input's elements come from ``raw_input_contents`` (one entry per input, in order, when the
client sends them that way, as tritonclient does) or from its ``contents``.
"""

from __future__ import annotations

import struct

from llmrpc.common.oip_bytes import NUMERIC, join_elements, split_elements
from llmrpc.kserve import grpc_predict_v2_pb2 as pb
from llmrpc.server.errors import InvalidArgument
from llmrpc.server.kserve_request import (
    SAMPLING_PARAMETERS,
    TEXT_INPUT,
    InferRequest,
    check_parameter,
    decode_text,
    read_request,
    sampling_parameters,
)

MAX_SHAPE_DIMS = 8


def parameter_value(parameter: pb.InferParameter):
    choice = parameter.WhichOneof("parameter_choice")
    return None if choice is None else getattr(parameter, choice)


def _elements(request: pb.ModelInferRequest, index: int) -> list:
    tensor = request.inputs[index]
    where = f"inputs[{index}] ({tensor.name})"
    raw = request.raw_input_contents[index] if request.raw_input_contents else None
    if tensor.datatype == "BYTES":
        if raw is None:
            return list(tensor.contents.bytes_contents)
        try:
            return split_elements(raw)
        except ValueError as error:
            raise InvalidArgument(where, str(error)) from None
    if tensor.datatype not in NUMERIC:
        raise InvalidArgument(f"{where}.datatype", f"unknown datatype {tensor.datatype!r}")
    contents, element = NUMERIC[tensor.datatype]
    if raw is None:
        return list(getattr(tensor.contents, contents))
    size = struct.calcsize(element)
    if len(raw) % size:
        raise InvalidArgument(where, f"raw data is not a whole number of {tensor.datatype}")
    return list(struct.unpack(f"<{len(raw) // size}{element}", raw))


def _check_shape(request: pb.ModelInferRequest, index: int, count: int) -> list[int]:
    tensor = request.inputs[index]
    shape = list(tensor.shape) or [count]
    if len(shape) > MAX_SHAPE_DIMS or any(dim < 0 for dim in shape):
        raise InvalidArgument(f"inputs[{index}].shape", f"not a tensor's shape: {shape}")
    product = 1
    for dim in shape:
        product *= dim
    if product != count:
        raise InvalidArgument(
            f"inputs[{index}].shape", f"{shape} holds {product} elements, the data {count}"
        )
    return shape


def read_infer_request(request: pb.ModelInferRequest) -> InferRequest:
    """The prompts and parameters of ``request``; InvalidArgument naming what is wrong."""
    if request.raw_input_contents and len(request.raw_input_contents) != len(request.inputs):
        raise InvalidArgument("raw_input_contents", "give one entry per input, or none")
    texts, shape, from_json, from_inputs = None, [], {}, {}
    for index, tensor in enumerate(request.inputs):
        elements = _elements(request, index)
        tensor_shape = _check_shape(request, index, len(elements))
        if tensor.name == TEXT_INPUT:
            if tensor.datatype != "BYTES":
                raise InvalidArgument(f"inputs[{index}].datatype", "text_input must be BYTES")
            texts = [decode_text(TEXT_INPUT, element) for element in elements]
            shape = tensor_shape
            continue
        if len(elements) != 1:
            raise InvalidArgument(tensor.name, f"give one element, got {len(elements)}")
        value = elements[0]
        if tensor.name == SAMPLING_PARAMETERS:
            from_json = sampling_parameters(value)
        else:
            is_text = tensor.datatype == "BYTES"
            from_inputs[tensor.name] = decode_text(tensor.name, value) if is_text else value
    if texts is None:
        for name, value in from_inputs.items():
            check_parameter(name, value)  # an input of an unknown name: that is the error
        raise InvalidArgument(TEXT_INPUT, "the BYTES input text_input holds the prompt")
    given = {name: parameter_value(p) for name, p in request.parameters.items()}
    parameters = {**from_json, **given, **from_inputs}
    return read_request(texts, shape, parameters, [output.name for output in request.outputs])


def infer_response(
    request: pb.ModelInferRequest, model: str, outputs: dict[str, tuple[str, list, list[int]]]
) -> pb.ModelInferResponse:
    """``outputs``: name -> (datatype, elements, shape), BYTES elements as bytes. The elements
    go in ``raw_output_contents``, as Triton sends them."""
    response = pb.ModelInferResponse(
        model_name=model, model_version=request.model_version or "1", id=request.id
    )
    for name, (datatype, elements, shape) in outputs.items():
        response.outputs.add(name=name, datatype=datatype, shape=shape)
        if datatype == "BYTES":
            response.raw_output_contents.append(join_elements(elements))
        else:
            packed = struct.pack(f"<{len(elements)}{NUMERIC[datatype][1]}", *elements)
            response.raw_output_contents.append(packed)
    return response
