"""GenerationService and TokenizationService: thin handlers over the engine client
(``EngineClient``: the engine core on a thread or in a process of its own); conversion lives in
``convert``, the reading of chat outputs (reasoning, tool calls) in ``output_parsing``. Prompts
are tokenized and chats rendered here, on the server's tokenizer workers (``tokenization``); the
engine receives token ids.

A call whose client cancels or whose deadline passes has its handler task cancelled by grpc.aio;
``aclosing`` then closes the engine's output stream, which aborts the request and frees its KV
blocks at once. The request id comes from the request-id interceptor (``logs``).
"""

from __future__ import annotations

import logging
import time
from contextlib import aclosing

from llmrpc.server import convert, output_parsing
from llmrpc.server.auth import caller_var, fair_share_caller
from llmrpc.server.chat_render import check_request_template
from llmrpc.server.errors import Internal, NotFound, handle_errors
from llmrpc.server.limits import batch_of
from llmrpc.server.logs import current_request_id, log_output, log_request
from llmrpc.server.output_parsing import ResponseParsing
from llmrpc.server.state import ServerState
from llmrpc.server.structured_output import after_reasoning
from llmrpc.server.tracing import traced_call
from llmrpc.v1 import generation_pb2_grpc, tokenization_pb2_grpc

logger = logging.getLogger(__name__)


class GenerationServicer(generation_pb2_grpc.GenerationServiceServicer):
    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def _prepare(self, request, context, engine, adapter: str | None):
        check_request_template(request.chat, self.state.trust_request_chat_template)
        # Tokenizing, chat rendering and the tools' checks grow with the input: off the loop.
        prompt, params, plan = await self.state.tokenization.run(
            _to_engine_request,
            request,
            engine.model_info,
            _deadline(context),
            self.state.output_parsers,
        )
        if adapter is not None:  # ``model`` named an adapter (convert read ``lora``)
            params.lora_name = adapter
        params.caller = fair_share_caller(context)
        logs = self.state.logs
        if logs.enable_log_requests:
            text = request.text if request.WhichOneof("input") == "text" else None
            log_request(text, prompt, params, logs.max_log_len)
        parsing = ResponseParsing(plan) if plan is not None else None
        return current_request_id(), prompt, params, parsing

    @handle_errors
    async def Generate(self, request, context):
        outputs, parsing = await self._generate(request, context)
        response = outputs.unary_response()
        if parsing is not None:
            parsing.unary(response)
        return response

    @handle_errors
    async def GenerateStream(self, request, context):
        await self._generate(request, context, stream_to=context)

    async def _generate(self, request, context, stream_to=None, on_output=None):
        """Run one request to its end; with ``stream_to``, write each delta as it comes; with
        ``on_output``, await ``on_output(prompt_token_ids, delta)`` for each engine output (the
        services that answer in their own messages: ``vllm_engine``). Returns the outputs and
        how chat outputs are read (None: as they are)."""
        engine = self.state.require_engine()
        model, adapter = self.state.model_target(request.model, request.lora)
        try:
            target = (model, adapter)
            return await self._run(request, context, engine, target, stream_to, on_output)
        except NotFound as error:
            if adapter is not None and error.field == "lora":  # no adapter of ``model``'s name
                raise await self.state.adapter_not_found(engine, request.model) from None
            raise

    async def _run(self, request, context, engine, target, stream_to, on_output=None):
        # A place in the queue first: a request waiting for a tokenizer worker waits too.
        num_samples = max(request.sampling.n, 1) if request.sampling.HasField("n") else 1
        admission = self.state.admission
        admission.check_samples(num_samples)
        batch = batch_of(context.invocation_metadata(), caller_var.get().key_digest)
        with admission.admit(engine, num_samples, batch), convert.engine_errors(request):
            prepared = await self._prepare(request, context, engine, target[1])
            request_id, prompt, params, parsing = prepared
            traced = traced_call()  # None unless tracing is on and this call is sampled
            if traced is not None:
                traced.ask_timings(params, target[0])
            outputs_so_far = convert.OutputAccumulator(
                request_id, params, self.state.tokenization.tokenizer
            )
            async with aclosing(engine.generate(request_id, prompt, params)) as outputs:
                async for output in outputs:
                    if output.timings is not None:  # a traced sample's last output
                        traced.engine_spans(output)
                    _raise_engine_failure(output)
                    outputs_so_far.add(output)
                    if on_output is not None:
                        await on_output(prompt, output)
                    if stream_to is not None:
                        response = outputs_so_far.stream_response(output)
                        if parsing is not None:
                            parsing.stream(response)
                        await stream_to.write(response)
        if self.state.logs.enable_log_outputs:
            log_output(outputs_so_far.samples[0], self.state.logs.max_log_len)
        return outputs_so_far, parsing


def _deadline(context) -> float | None:
    """The call's deadline on the engine's clock (``time.monotonic()``), if it has one."""
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining


def _raise_engine_failure(output) -> None:
    message = convert.engine_failure(output)
    if message is not None:
        logger.error("the request failed in the engine: %s", message)
        raise Internal(f"the engine failed while serving request {current_request_id()}: {message}")


class TokenizationServicer(tokenization_pb2_grpc.TokenizationServiceServicer):
    def __init__(self, state: ServerState) -> None:
        self.state = state

    @handle_errors
    async def Tokenize(self, request, context):
        engine = self.state.require_engine()
        await self._check_model(engine, request.model)
        check_request_template(request.chat, self.state.trust_request_chat_template)
        parsers = self.state.output_parsers
        tokenization = self.state.tokenization
        return await tokenization.run(_tokenize, request, engine.model_info, parsers)

    @handle_errors
    async def Detokenize(self, request, context):
        engine = self.state.require_engine()
        await self._check_model(engine, request.model)
        return await self.state.tokenization.run(_detokenize, request, engine.model_info)

    async def _check_model(self, engine, requested: str) -> None:
        """``model`` names a served model or a loaded LoRA adapter (one of ListModels' names):
        an adapter uses its base model's tokenizer. Anything else is NOT_FOUND."""
        try:
            self.state.model_name(requested)
        except NotFound:
            if not self.state.lora_enabled:
                raise
            adapters = await engine.list_lora_adapters()
            if requested not in {adapter["name"] for adapter in adapters}:
                raise await self.state.adapter_not_found(engine, requested) from None


# Worker-side adapters: the worker's own tokenizer comes first.
def _to_engine_request(tokenizer, request, model_info, deadline, parsers):
    """``(prompt, params, plan)``: the engine's request, and how its outputs are read."""
    plan = output_parsing.plan_request(request, parsers)
    request = output_parsing.prepared_request(request, plan)
    prompt, params = convert.to_engine_request(request, tokenizer, model_info, deadline)
    reasoning = plan.parsers.reasoning_parser if plan is not None else None
    if reasoning is not None and params.structured_output is not None:
        spec = params.structured_output
        params.structured_output = after_reasoning(spec, prompt, tokenizer, reasoning)
    return prompt, params, plan


def _tokenize(tokenizer, request, model_info, parsers):
    request = output_parsing.prepared_tokenize_request(request, parsers)
    return convert.tokenize(request, tokenizer, model_info)


def _detokenize(tokenizer, request, model_info):
    return convert.detokenize(request, tokenizer, model_info)
