"""KServe v2 / Open Inference Protocol REST bodies <-> the protocol's gRPC messages.

The REST routes (``kserve_routes``) pass every request on to the server's
``inference.GRPCInferenceService``, which reads prompts and parameters and checks them; here the
JSON tensors (and Triton's binary tensor extension: a JSON header of
``Inference-Header-Content-Length`` bytes, then each binary tensor's bytes in order) become
``ModelInferRequest`` fields, and responses become JSON again (binary outputs when asked).
``ValueError`` names what is wrong in the body.
"""

from __future__ import annotations

import struct

from llmrpc.common.oip_bytes import NUMERIC, join_elements, split_elements
from llmrpc.kserve import grpc_predict_v2_pb2 as pb

MAX_ELEMENTS = 1024  # elements of one tensor over REST: prompts, parameters


def set_parameters(target, parameters, where: str) -> None:
    """A JSON object of parameters into a ``map<string, InferParameter>``."""
    if parameters is None:
        return
    if not isinstance(parameters, dict):
        raise ValueError(f"{where}: must be a JSON object")
    for name, value in parameters.items():
        parameter = target[name]
        if isinstance(value, bool):
            parameter.bool_param = value
        elif isinstance(value, int) and -(2**63) <= value < 2**63:
            parameter.int64_param = value
        elif isinstance(value, float):
            parameter.double_param = value
        elif isinstance(value, str):
            parameter.string_param = value
        else:
            raise ValueError(f"{name}: a parameter is a boolean, a number or a string")


def _flat(data, where: str) -> list:
    """A tensor's ``data``: a list, nested in row-major order or flat."""
    if not isinstance(data, list):
        data = [data]
    flat: list = []
    stack = [iter(data)]
    while stack:
        item = next(stack[-1], _DONE)
        if item is _DONE:
            stack.pop()
        elif isinstance(item, list):
            if len(stack) > 8:
                raise ValueError(f"{where}.data: nested too deep")
            stack.append(iter(item))
        else:
            flat.append(item)
            if len(flat) > MAX_ELEMENTS:
                raise ValueError(f"{where}.data: at most {MAX_ELEMENTS} elements")
    return flat


_DONE = object()


def _raw_of(datatype: str, elements: list, where: str) -> bytes:
    try:
        if datatype == "BYTES":
            return join_elements([_as_bytes(e, where) for e in elements])
        return struct.pack(f"<{len(elements)}{NUMERIC[datatype][1]}", *elements)
    except (struct.error, TypeError):
        raise ValueError(f"{where}.data: not {datatype} elements") from None


def _as_bytes(element, where: str) -> bytes:
    if not isinstance(element, str):
        raise ValueError(f"{where}.data: BYTES elements are strings")
    return element.encode()


def _input(request: pb.ModelInferRequest, index: int, tensor, binary: memoryview, offset: int):
    """Adds ``tensor`` (a JSON input) to ``request``; the raw bytes it took from ``binary``
    (None: its data is in JSON) and the offset after them."""
    where = f"inputs[{index}]"
    if not isinstance(tensor, dict) or not isinstance(tensor.get("name"), str):
        raise ValueError(f"{where}: an input is an object with a name")
    datatype, shape = tensor.get("datatype"), tensor.get("shape", [])
    if datatype != "BYTES" and datatype not in NUMERIC:
        raise ValueError(f"{where}.datatype: unknown datatype {datatype!r}")
    if not isinstance(shape, list) or not all(isinstance(d, int) for d in shape):
        raise ValueError(f"{where}.shape: a list of integers")
    added = request.inputs.add(name=tensor["name"], datatype=datatype, shape=shape)
    parameters = dict(tensor.get("parameters") or {})
    size = parameters.pop("binary_data_size", None)
    set_parameters(added.parameters, parameters, f"{where}.parameters")
    if size is not None:
        if not isinstance(size, int) or size < 0 or offset + size > len(binary):
            raise ValueError(f"{where}.parameters.binary_data_size: past the binary data")
        return bytes(binary[offset : offset + size]), offset + size
    elements = _flat(tensor.get("data", []), where)
    if datatype == "BYTES":
        added.contents.bytes_contents.extend(_as_bytes(e, where) for e in elements)
    else:
        try:
            getattr(added.contents, NUMERIC[datatype][0]).extend(elements)
        except (TypeError, ValueError):
            raise ValueError(f"{where}.data: not {datatype} elements") from None
    return None, offset


def infer_request(model: str, body, binary: bytes = b"") -> pb.ModelInferRequest:
    """The ``ModelInferRequest`` of a REST infer body (``binary``: the bytes after its JSON)."""
    if not isinstance(body, dict):
        raise ValueError("the body is a JSON object")
    request = pb.ModelInferRequest(model_name=model, id=str(body.get("id", "")))
    set_parameters(request.parameters, body.get("parameters"), "parameters")
    inputs = body.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise ValueError("inputs: a list of input tensors")
    raws, offset, view = [], 0, memoryview(binary)
    for index, tensor in enumerate(inputs):
        raw, offset = _input(request, index, tensor, view, offset)
        raws.append(raw)
    if any(raw is not None for raw in raws):  # then every input goes raw, as gRPC wants
        for index, (tensor, raw) in enumerate(zip(request.inputs, raws, strict=True)):
            if raw is None:
                raw = _raw_of(tensor.datatype, _contents(tensor), f"inputs[{index}]")
                tensor.ClearField("contents")
            request.raw_input_contents.append(raw)
    for index, output in enumerate(body.get("outputs") or []):
        if not isinstance(output, dict) or not isinstance(output.get("name"), str):
            raise ValueError(f"outputs[{index}]: an output is an object with a name")
        added = request.outputs.add(name=output["name"])
        parameters = dict(output.get("parameters") or {})
        parameters.pop("binary_data", None)  # how the answer is framed: kserve_routes' part
        set_parameters(added.parameters, parameters, f"outputs[{index}].parameters")
    return request


def _contents(tensor) -> list:
    if tensor.datatype == "BYTES":
        return [e.decode() for e in tensor.contents.bytes_contents]
    return list(getattr(tensor.contents, NUMERIC[tensor.datatype][0]))


def binary_outputs(body: dict) -> set[str]:
    """The outputs a REST infer body asks for in binary form."""
    everything = bool((body.get("parameters") or {}).get("binary_data_output"))
    named = {
        output.get("name")
        for output in body.get("outputs") or []
        if isinstance(output, dict) and (output.get("parameters") or {}).get("binary_data")
    }
    if everything and not body.get("outputs"):
        return {"*"}
    return named | ({"*"} if everything else set())


def output_elements(response: pb.ModelInferResponse, index: int) -> list:
    """Output ``index``'s elements: BYTES as text, numbers as numbers."""
    output = response.outputs[index]
    if not response.raw_output_contents:
        return _contents(output)
    raw = response.raw_output_contents[index]
    if output.datatype == "BYTES":
        return [e.decode("utf-8", "replace") for e in split_elements(raw)]
    element = NUMERIC[output.datatype][1]
    return list(struct.unpack(f"<{len(raw) // struct.calcsize(element)}{element}", raw))


def infer_response(response: pb.ModelInferResponse, binary: set[str]) -> tuple[dict, bytes]:
    """The JSON of a ModelInferResponse and the bytes of its binary outputs (in order)."""
    body: dict = {"model_name": response.model_name, "model_version": response.model_version}
    if response.id:
        body["id"] = response.id
    tail = b""
    outputs = []
    for index, output in enumerate(response.outputs):
        entry = {"name": output.name, "datatype": output.datatype, "shape": list(output.shape)}
        if ("*" in binary or output.name in binary) and response.raw_output_contents:
            raw = response.raw_output_contents[index]
            entry["parameters"] = {"binary_data_size": len(raw)}
            tail += raw
        else:
            entry["data"] = output_elements(response, index)
        outputs.append(entry)
    body["outputs"] = outputs
    return body, tail
