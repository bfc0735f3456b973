"""``inference.GRPCInferenceService``: KServe v2 / the Open Inference Protocol, with Triton's
streaming extension, served beside the v1 services on the same port.

A model here is a text generator, as Triton's vLLM backend serves one: the BYTES input
``text_input`` in, the BYTES output ``text_output`` out (``kserve_request`` reads the rest).
Each prompt runs as a v1 ``GenerateRequest`` through ``GenerationServicer``, so admission,
tokenization off the loop, cancellation (the client's cancel aborts the engine request) and
the engine's errors are the v1 API's. Errors are gRPC statuses with ``google.rpc`` details,
field names in the caller's terms (``temperature``, not ``sampling.temperature``). On
ModelStreamInfer one request's error does not end the stream: as Triton does, it comes as the
response's ``error_message`` (prefixed with the status code's name) with the request's id, and
the stream goes on.

Unary responses hold the prompt and its output unless ``exclude_input_in_output`` is true;
streamed ones hold each new piece of output (Triton's vLLM backend does both).
"""

from __future__ import annotations

import asyncio
import contextlib

from llmrpc.kserve import grpc_predict_v2_pb2 as pb
from llmrpc.kserve import grpc_predict_v2_pb2_grpc as pb_grpc
from llmrpc.server.errors import InvalidArgument, NotFound, ServiceError, handle_errors
from llmrpc.server.kserve_request import TEXT_INPUT, TEXT_OUTPUT, V1_FIELD_NAMES, InferRequest
from llmrpc.server.kserve_tensors import infer_response, read_infer_request
from llmrpc.server.logs import current_request_id, request_id_var
from llmrpc.server.servicers import GenerationServicer
from llmrpc.server.state import ServerState, server_version
from llmrpc.v1 import generation_pb2

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name
VERSIONS = ("1",)  # one version of each served model
PLATFORM = "llmrpc"
EXTENSIONS = ("parameters", "binary_tensor_data", "generate")
_FINISH_REASONS = {  # v1 finish reasons -> the words Triton's vLLM backend answers
    generation_pb2.FINISH_REASON_LENGTH: "length",
    generation_pb2.FINISH_REASON_STOP_STRING: "stop",
    generation_pb2.FINISH_REASON_STOP_TOKEN: "stop",
    generation_pb2.FINISH_REASON_EOS: "stop",
    generation_pb2.FINISH_REASON_ABORT: "abort",
    generation_pb2.FINISH_REASON_TIME_LIMIT: "time_limit",
    generation_pb2.FINISH_REASON_ERROR: "error",
}


def _tensor(name: str, datatype: str, shape: list[int]):
    return pb.ModelMetadataResponse.TensorMetadata(name=name, datatype=datatype, shape=shape)


MODEL_INPUTS = (
    _tensor(TEXT_INPUT, "BYTES", [-1]),
    _tensor("stream", "BOOL", [1]),
    _tensor("sampling_parameters", "BYTES", [1]),
    _tensor("exclude_input_in_output", "BOOL", [1]),
)
MODEL_OUTPUTS = (
    _tensor(TEXT_OUTPUT, "BYTES", [-1]),
    _tensor("finish_reason", "BYTES", [-1]),
    _tensor("num_input_tokens", "UINT32", [-1]),
    _tensor("num_output_tokens", "UINT32", [-1]),
)


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, state: ServerState, generation: GenerationServicer, health) -> None:
        self.state = state
        self.generation = generation
        self.health = health  # server.health.Health: ready means SERVING

    @handle_errors
    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    @handle_errors
    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=self._ready())

    @handle_errors
    async def ModelReady(self, request, context):
        # An unknown model is not ready (as Triton answers), not an error.
        engine = self.state.engine
        names = engine.model_info.served_model_names if engine is not None else ()
        known = request.name in names and request.version in ("", *VERSIONS)
        return pb.ModelReadyResponse(ready=known and self._ready())

    @handle_errors
    async def ServerMetadata(self, request, context):
        return pb.ServerMetadataResponse(
            name=PLATFORM, version=server_version(), extensions=EXTENSIONS
        )

    @handle_errors
    async def ModelMetadata(self, request, context):
        name = self._model(request.name, request.version, "name")
        return pb.ModelMetadataResponse(
            name=name, versions=VERSIONS, platform=PLATFORM,
            inputs=MODEL_INPUTS, outputs=MODEL_OUTPUTS,
        )  # fmt: skip

    @handle_errors
    async def ModelInfer(self, request, context):
        model = self._model(request.model_name, request.model_version, "model_name")
        infer = read_infer_request(request)
        if infer.flag("stream"):
            raise InvalidArgument("stream", "ModelInfer answers once: stream with ModelStreamInfer")
        return await self._infer(request, infer, model, context)

    @handle_errors
    async def ModelStreamInfer(self, request_iterator, context):
        """Each request runs in a task of its own, its responses written as they come; the
        call ends once the client has sent all and every answer is written."""
        writes = asyncio.Lock()
        tasks: set[asyncio.Task] = set()
        try:
            async for number, request in _numbered(request_iterator):
                task = asyncio.create_task(self._stream_one(request, number, context, writes))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            if tasks:
                await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()

    async def _stream_one(self, request, number: int, context, writes: asyncio.Lock) -> None:
        request_id_var.set(f"{current_request_id()}-{number}")

        async def write(response: pb.ModelInferResponse) -> None:
            async with writes:
                await context.write(pb.ModelStreamInferResponse(infer_response=response))

        try:
            model = self._model(request.model_name, request.model_version, "model_name")
            infer = read_infer_request(request)
            if not infer.flag("stream"):
                await write(await self._infer(request, infer, model, context))
                return
            await self._stream(request, infer, model, context, write)
        except ServiceError as error:
            failed = pb.ModelInferResponse(model_name=request.model_name, id=request.id)
            message = f"{error.code.name}: {error.message}"
            async with writes:
                await context.write(
                    pb.ModelStreamInferResponse(error_message=message, infer_response=failed)
                )

    def _ready(self) -> bool:
        engine = self.state.engine
        return engine is not None and engine.dead_error is None and self.health.serving

    def _model(self, name: str, version: str, field: str) -> str:
        """The served model ``name`` (empty: the default) names; NotFound naming ``field``."""
        served = self.state.require_engine().model_info.served_model_names
        if name and name not in served:
            listed = ", ".join(served)
            raise NotFound("model", name, field, f"no model {name!r} here; served: {listed}")
        if version not in ("", *VERSIONS):
            raise NotFound("model version", version, "model_version", "the version served is 1")
        return name or served[0]

    async def _infer(self, request, infer: InferRequest, model: str, context):
        """One response for all of ``infer``'s prompts, generated side by side (at most
        --max-prompts-per-request, on ModelInfer and ModelStreamInfer alike)."""
        self.state.admission.check_prompts(len(infer.prompts), TEXT_INPUT)
        runs = [
            self._generate(infer, prompt, model, context, index)
            for index, prompt in enumerate(infer.prompts)
        ]
        results = await asyncio.gather(*runs)
        prefixes = [""] * len(results) if infer.flag("exclude_input_in_output") else infer.prompts
        texts = [prefix + r.text for prefix, r in zip(prefixes, results, strict=True)]
        return _response(request, infer, model, texts, results, infer.shape)

    async def _generate(self, infer: InferRequest, prompt: str, model: str, context, index: int):
        if len(infer.prompts) > 1:  # each prompt is an engine request with an id of its own
            request_id_var.set(f"{current_request_id()}-{index}")
        with _in_our_terms():
            outputs, _ = await self.generation._generate(
                infer.generate_request(prompt, model), context
            )
        return outputs.unary_response()

    async def _stream(self, request, infer: InferRequest, model: str, context, write) -> None:
        prompt = "" if infer.flag("exclude_input_in_output", True) else infer.prompts[0]
        generate = infer.generate_request(infer.prompts[0], model)

        class _Writer:  # GenerationServicer writes v1 deltas; they go out as OIP responses
            async def write(_, delta: generation_pb2.GenerateResponse) -> None:
                nonlocal prompt
                final = delta.finish_reason != generation_pb2.FINISH_REASON_UNSPECIFIED
                if not (delta.text or prompt or final):  # the last one always goes: it ends
                    return
                response = _response(request, infer, model, [prompt + delta.text], [delta], [1])
                response.parameters["triton_final_response"].bool_param = final
                prompt = ""
                await write(response)

        with _in_our_terms():
            await self.generation._generate(generate, context, stream_to=_Writer())


async def _numbered(request_iterator):
    number = 0
    async for request in request_iterator:
        number += 1
        yield number, request


@contextlib.contextmanager
def _in_our_terms():
    """InvalidArgument from the v1 API's checks, naming the parameter as the caller named it."""
    try:
        yield
    except InvalidArgument as error:
        name = V1_FIELD_NAMES.get(error.field)
        if name is None:
            raise
        raise InvalidArgument(name, error.message.removeprefix(f"{error.field}: ")) from None


def _response(request, infer: InferRequest, model: str, texts, results, shape):
    available = {
        TEXT_OUTPUT: ("BYTES", [text.encode() for text in texts]),
        "finish_reason": ("BYTES", [_finish_reason(r).encode() for r in results]),
        "num_input_tokens": ("UINT32", [r.usage.prompt_tokens for r in results]),
        "num_output_tokens": ("UINT32", [r.usage.completion_tokens for r in results]),
    }
    outputs = {name: (*available[name], shape) for name in infer.outputs}
    return infer_response(request, model, outputs)


def _finish_reason(result: generation_pb2.GenerateResponse) -> str:
    return _FINISH_REASONS.get(result.finish_reason, "")
