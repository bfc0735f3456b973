"""KServe v2 / Open Inference Protocol over REST, with Triton's generate extension.

    GET  /v2                              server metadata
    GET  /v2/health/live, /v2/health/ready
    GET  /v2/models/{model}               model metadata
    GET  /v2/models/{model}/ready
    POST /v2/models/{model}/infer         JSON tensors (Triton's binary tensors too)
    POST /v2/models/{model}/generate      {"text_input": ..., "parameters": {...}} -> text_output
    POST /v2/models/{model}/generate_stream   the same, as server-sent events: one
                                          ``data: {...}`` per piece of text

Each calls the server's ``inference.GRPCInferenceService``, which checks what it is given.
Errors are ``{"error": "..."}`` with the gRPC status's HTTP status (an unknown model: 404, a
bad parameter: 400 naming it). A client that leaves stops its request in the engine. Inferences
are counted in the gateway's request metrics (``/metrics``) as its OpenAI requests are: the
gateway asks the server for each prompt's token counts and finish reason too, and hands the
client only the outputs it asked for.
"""

from __future__ import annotations

import asyncio
import json

import grpc
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from llmrpc.clients import LlmrpcError
from llmrpc.gateway import kserve_json
from llmrpc.gateway.errors import OpenAIError, http_status
from llmrpc.gateway.json_body import OFF_LOOP_BYTES, parse
from llmrpc.gateway.metrics import RequestTimer
from llmrpc.gateway.sse import until_disconnect
from llmrpc.gateway.state import gateway_of, request_id
from llmrpc.kserve import grpc_predict_v2_pb2 as pb

# Not in the OpenAPI schema: these bodies are the protocol's (its JSON tensors, Triton's binary
# ones), described by its own specification, not by models of ours.
router = APIRouter(include_in_schema=False)
HEADER_LENGTH = "inference-header-content-length"
_GENERATE_KEYS = ("text_input", "parameters", "id")


# the outputs a request's metrics need -> the parameter that asks for each
_COUNTED = {
    "num_input_tokens": "return_num_input_tokens",
    "num_output_tokens": "return_num_output_tokens",
    "finish_reason": "return_finish_reason",
}


class _Counted:
    """One inference's timer, and the outputs it added to the request for its counts."""

    def __init__(self, request: Request, message: pb.ModelInferRequest) -> None:
        self.timer = RequestTimer(gateway_of(request).metrics)
        self.added: set[str] = set()
        listed = {output.name for output in message.outputs}
        inputs = {tensor.name for tensor in message.inputs}  # Triton's flags may come as inputs
        for name, flag in _COUNTED.items():
            if listed:
                if name not in listed:  # a list of outputs: exactly those come back
                    message.outputs.add(name=name)
                    self.added.add(name)
            elif flag not in inputs and not (
                flag in message.parameters and message.parameters[flag].bool_param
            ):
                message.parameters[flag].bool_param = True
                self.added.add(name)

    def finish(self, reply: pb.ModelInferResponse) -> pb.ModelInferResponse:
        """Records ``reply``'s counts; returns it without the outputs the client did not ask for."""
        found = {o.name: kserve_json.output_elements(reply, i) for i, o in enumerate(reply.outputs)}
        reasons = [str(reason) for reason in found.get("finish_reason", ())]
        self.timer.finish(
            sum(found.get("num_input_tokens", ())), sum(found.get("num_output_tokens", ())), reasons
        )
        return self.strip(reply)

    def strip(self, reply: pb.ModelInferResponse) -> pb.ModelInferResponse:
        if not self.added:
            return reply
        kept = [i for i, output in enumerate(reply.outputs) if output.name not in self.added]
        outputs = [reply.outputs[i] for i in kept]
        raw = [reply.raw_output_contents[i] for i in kept] if reply.raw_output_contents else []
        del reply.outputs[:]
        reply.outputs.extend(outputs)
        del reply.raw_output_contents[:]
        reply.raw_output_contents.extend(raw)
        return reply


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def _from_grpc(error: LlmrpcError) -> JSONResponse:
    return _error(http_status(error.code), error.message)


async def _call(request: Request, method: str, message):
    return await gateway_of(request).pool.call(
        "kserve_call", method, message, request_id=request_id(request)
    )


async def _counted_infer(request: Request, message: pb.ModelInferRequest) -> pb.ModelInferResponse:
    """ModelInfer, counted in the gateway's metrics; the reply holds the outputs the client
    asked for. Raises LlmrpcError."""
    counted = _Counted(request, message)
    reply = await until_disconnect(request, _call(request, "ModelInfer", message))
    return counted.finish(reply)


async def _json(request: Request, body: bytes):
    try:
        if len(body) > OFF_LOOP_BYTES:
            return await asyncio.to_thread(parse, body)
        return parse(body)
    except OpenAIError as error:
        raise ValueError(error.message) from None


@router.get("/v2")
async def server_metadata(request: Request):
    try:
        reply = await _call(request, "ServerMetadata", pb.ServerMetadataRequest())
    except LlmrpcError as error:
        return _from_grpc(error)
    return {"name": reply.name, "version": reply.version, "extensions": list(reply.extensions)}


@router.get("/v2/health/live")
async def server_live() -> dict:
    return {"live": True}  # this answer is the proof


@router.get("/v2/health/ready")
async def server_ready(request: Request):
    try:
        ready = (await _call(request, "ServerReady", pb.ServerReadyRequest())).ready
    except LlmrpcError as error:
        if error.code != grpc.StatusCode.UNAVAILABLE:
            return _from_grpc(error)
        ready = False
    return JSONResponse({"ready": ready}, status_code=200 if ready else 503)


@router.get("/v2/models/{model}")
async def model_metadata(model: str, request: Request):
    try:
        reply = await _call(request, "ModelMetadata", pb.ModelMetadataRequest(name=model))
    except LlmrpcError as error:
        return _from_grpc(error)
    tensors = lambda ts: [  # noqa: E731
        {"name": t.name, "datatype": t.datatype, "shape": list(t.shape)} for t in ts
    ]
    return {
        "name": reply.name, "versions": list(reply.versions), "platform": reply.platform,
        "inputs": tensors(reply.inputs), "outputs": tensors(reply.outputs),
    }  # fmt: skip


@router.get("/v2/models/{model}/ready")
async def model_ready(model: str, request: Request):
    try:  # metadata first: an unknown model is a 404, not "not ready"
        await _call(request, "ModelMetadata", pb.ModelMetadataRequest(name=model))
        ready = (await _call(request, "ModelReady", pb.ModelReadyRequest(name=model))).ready
    except LlmrpcError as error:
        return _from_grpc(error)
    return JSONResponse({"name": model, "ready": ready}, status_code=200 if ready else 503)


@router.post("/v2/models/{model}/infer")
async def infer(model: str, request: Request):
    raw = await request.body()
    header_length = request.headers.get(HEADER_LENGTH)
    try:
        split = _header_length(header_length, len(raw))
        body = await _json(request, raw[:split])
        message = kserve_json.infer_request(model, body, raw[split:])
    except ValueError as error:
        return _error(400, str(error))
    try:
        reply = await _counted_infer(request, message)
    except LlmrpcError as error:
        return _from_grpc(error)
    document, tail = kserve_json.infer_response(reply, kserve_json.binary_outputs(body))
    if not tail and not any("parameters" in o for o in document["outputs"]):
        return JSONResponse(document)
    head = json.dumps(document).encode()
    headers = {"Inference-Header-Content-Length": str(len(head))}
    return Response(head + tail, media_type="application/octet-stream", headers=headers)


def _header_length(value: str | None, size: int) -> int:
    if value is None:
        return size
    if not value.isdigit() or int(value) > size:
        raise ValueError("Inference-Header-Content-Length: the length of the JSON header")
    return int(value)


async def _generate_request(model: str, request: Request, stream: bool) -> pb.ModelInferRequest:
    """Triton's generate body: ``text_input`` (a string, or a list of them), ``parameters``,
    and any other key as a one-element input of that name (``stream``,
    ``exclude_input_in_output``, ``sampling_parameters``, ``max_tokens``...)."""
    body = await _json(request, await request.body())
    if not isinstance(body, dict):
        raise ValueError("the body is a JSON object")
    text = body.get("text_input")
    texts = text if isinstance(text, list) else [text]
    if text is None or not all(isinstance(t, str) for t in texts):
        raise ValueError("text_input: a string, or a list of strings")
    tensors = [{"name": "text_input", "datatype": "BYTES", "shape": [len(texts)], "data": texts}]
    for name, value in body.items():
        if name not in _GENERATE_KEYS:
            tensors.append(_scalar_input(name, value))
    inputs = {"id": body.get("id", ""), "parameters": body.get("parameters"), "inputs": tensors}
    message = kserve_json.infer_request(model, inputs)
    if stream:
        message.parameters["stream"].bool_param = True
    return message


def _scalar_input(name: str, value) -> dict:
    if isinstance(value, bool):
        datatype = "BOOL"
    elif isinstance(value, int):
        datatype = "INT64"
    elif isinstance(value, float):
        datatype = "FP64"
    elif isinstance(value, str):
        datatype = "BYTES"
    elif isinstance(value, (dict, list)) and name == "sampling_parameters":
        value, datatype = json.dumps(value), "BYTES"
    else:
        raise ValueError(f"{name}: a boolean, a number or a string")
    return {"name": name, "datatype": datatype, "shape": [1], "data": [value]}


def _generate_body(reply: pb.ModelInferResponse) -> dict:
    """Triton's generate answer: each output by name, a one-element one as its element."""
    body: dict = {"model_name": reply.model_name, "model_version": reply.model_version}
    if reply.id:
        body["id"] = reply.id
    for index, output in enumerate(reply.outputs):
        elements = kserve_json.output_elements(reply, index)
        body[output.name] = elements[0] if len(elements) == 1 else elements
    return body


@router.post("/v2/models/{model}/generate")
async def generate(model: str, request: Request):
    try:
        message = await _generate_request(model, request, stream=False)
    except ValueError as error:
        return _error(400, str(error))
    try:
        reply = await _counted_infer(request, message)
    except LlmrpcError as error:
        return _from_grpc(error)
    return _generate_body(reply)


@router.post("/v2/models/{model}/generate_stream")
async def generate_stream(model: str, request: Request):
    try:
        message = await _generate_request(model, request, stream=True)
    except ValueError as error:
        return _error(400, str(error))
    counted = _Counted(request, message)
    pool = gateway_of(request).pool
    replies = pool.stream("kserve_stream", message, request_id=request_id(request))
    try:  # the first reply before the status: an error before any text is the HTTP status
        first = await until_disconnect(request, anext(replies))
    except LlmrpcError as error:
        return _from_grpc(error)
    except StopAsyncIteration:
        first = None
    if first is not None and first.error_message:
        return _error(_status_of(first.error_message), first.error_message)
    return StreamingResponse(_events(first, replies, counted), media_type="text/event-stream")


def _status_of(error_message: str) -> int:
    """The HTTP status of a stream's error: its text starts with the gRPC status code's name."""
    name = error_message.partition(":")[0]
    code = getattr(grpc.StatusCode, name, grpc.StatusCode.UNKNOWN)
    return http_status(code)


async def _events(first, replies, counted: _Counted):
    try:
        reply = first
        while reply is not None:
            if reply.error_message:
                yield _event({"error": reply.error_message})
                return
            response = reply.infer_response
            final = response.parameters["triton_final_response"].bool_param
            counted.timer.tokens_arrived()
            response = counted.finish(response) if final else counted.strip(response)
            yield _event(_generate_body(response))
            reply = await anext(replies, None)
    except LlmrpcError as error:
        yield _event({"error": error.message})
    finally:
        await replies.aclose()  # a client gone: the stream's call is cancelled, the request too


def _event(body: dict) -> bytes:
    return b"data: " + json.dumps(body, ensure_ascii=False).encode() + b"\n\n"
