"""The client API, written once for ``Client`` and ``AsyncClient``.

Each public method builds its request and hands it, with the function that converts the
response, to ``_call`` (unary) or ``_stream`` (server streaming). ``Client`` implements those
two as blocking calls and ``AsyncClient`` as coroutines and async generators, so in
``AsyncClient`` every method below is awaited (``stream`` and ``chat_stream`` are iterated with
``async for``) and returns the type documented here.

Retries (see ``RetryPolicy``, UNAVAILABLE only) cover what is safe to repeat: every unary call,
as each is idempotent (``abort`` ignores ids no longer live, a second ``sleep`` or ``wake_up``
finds the state it would make, a lost ``generate`` gave the caller nothing), and a stream until
its first response arrives. A stream that has yielded is never retried: the caller has part of
an output that a new request would not continue.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmrpc.clients import requests, types
from llmrpc.clients.connection import ConnectionOptions, RetryPolicy
from llmrpc.clients.embedding import Embeddings, EmbedInput, embed_request, embeddings_from_proto
from llmrpc.clients.requests import ChatMessages, ChatOptions, Prompt
from llmrpc.kserve import grpc_predict_v2_pb2_grpc
from llmrpc.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    embedding_pb2_grpc,
    generation_pb2_grpc,
    tokenization_pb2_grpc,
)

DEFAULT_TARGET = "localhost:50051"


class ClientBase:
    """Connection handling and the API; subclasses supply ``_open_channel``, ``_call``,
    ``_stream`` and ``close``."""

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        model: str = "",
        tls: bool = False,
        ca_cert: str | Path | None = None,
        client_cert: str | Path | None = None,
        client_key: str | Path | None = None,
        server_name: str | None = None,
        api_key: str | None = None,
        timeout: float | None = None,
        retry: RetryPolicy | None = None,
        channel=None,
    ) -> None:
        """``model``: served model name for calls that do not name one ("": server default).

        ``timeout``: default deadline in seconds for each call, retries included; every method
        also takes ``timeout=``. ``channel``: one to use instead of opening one to ``target``
        (a server's in-process channel to itself). See ``ConnectionOptions`` for the others.
        """
        self.model = model
        self.options = ConnectionOptions(
            target=target,
            tls=tls,
            ca_cert=ca_cert,
            client_cert=client_cert,
            client_key=client_key,
            server_name=server_name,
            api_key=api_key,
            timeout=timeout,
            retry=retry or RetryPolicy(),
        )
        self._channel = self._open_channel() if channel is None else channel
        self._generation = generation_pb2_grpc.GenerationServiceStub(self._channel)
        self._tokenization = tokenization_pb2_grpc.TokenizationServiceStub(self._channel)
        self._admin = admin_pb2_grpc.AdminServiceStub(self._channel)
        self._embedding = embedding_pb2_grpc.EmbeddingServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._kserve = grpc_predict_v2_pb2_grpc.GRPCInferenceServiceStub(self._channel)

    @property
    def target(self) -> str:
        return self.options.target

    # --- generation ------------------------------------------------------------------------

    def generate(
        self,
        prompt: Prompt,
        *,
        model: str | None = None,
        request_id: str | None = None,
        timeout: float | None = None,
        **params,
    ) -> types.Completion:
        """Generate from text (tokenized by the server) or token ids; returns the whole output.

        ``params`` are ``GenerateParams`` fields, e.g. temperature, top_p, seed, max_tokens,
        stop, ignore_eos, n (samples: see ``Completion.samples``), logprobs, time_limit
        (seconds); unset ones take the server's defaults.
        """
        request = self._generate_request(prompt, None, model, request_id, params)
        return self._call(
            self._generation.Generate, request, types.completion_from_proto, timeout, request_id
        )

    def stream(
        self,
        prompt: Prompt,
        *,
        model: str | None = None,
        request_id: str | None = None,
        timeout: float | None = None,
        **params,
    ) -> Iterator[types.Delta]:
        """Like ``generate``, as deltas; the last has ``finish_reason`` and ``usage``.

        Closing the iterator early (``break``) cancels the call, which aborts the request.
        """
        request = self._generate_request(prompt, None, model, request_id, params)
        return self._stream(request, timeout, request_id)

    def chat(
        self,
        messages: ChatMessages,
        *,
        model: str | None = None,
        request_id: str | None = None,
        timeout: float | None = None,
        chat_options: ChatOptions | None = None,
        **params,
    ) -> types.Completion:
        """Answer OpenAI-shaped messages (``{"role": ..., "content": ...}``) rendered with the
        model's chat template (``chat_options`` adjust the rendering); ``params`` as in
        ``generate``."""
        request = self._generate_request(None, messages, model, request_id, params, chat_options)
        return self._call(
            self._generation.Generate, request, types.completion_from_proto, timeout, request_id
        )

    def chat_stream(
        self,
        messages: ChatMessages,
        *,
        model: str | None = None,
        request_id: str | None = None,
        timeout: float | None = None,
        chat_options: ChatOptions | None = None,
        **params,
    ) -> Iterator[types.Delta]:
        """``chat``, as deltas (see ``stream``)."""
        request = self._generate_request(None, messages, model, request_id, params, chat_options)
        return self._stream(request, timeout, request_id)

    def _generate_request(self, prompt, messages, model, request_id, params, chat_options=None):
        return requests.generate_request(
            prompt,
            messages=messages,
            model=self._model(model),
            request_id=request_id,
            chat_options=chat_options,
            **params,
        )

    def _model(self, model: str | None) -> str:
        return self.model if model is None else model

    # --- embeddings --------------------------------------------------------------------------

    def embed(
        self,
        inputs: Sequence[EmbedInput],
        *,
        dimensions: int | None = None,
        truncate_prompt_tokens: int | None = None,
        normalize: bool | None = None,
        model: str | None = None,
        timeout: float | None = None,
        request_id: str | None = None,
    ) -> Embeddings:
        """Embeddings of ``inputs`` (texts or token-id lists, at most 2048), one result per
        input in order; an input that failed has its own ``error`` (see ``clients.embedding``)."""
        request = embed_request(
            inputs,
            model=self._model(model),
            dimensions=dimensions,
            truncate_prompt_tokens=truncate_prompt_tokens,
            normalize=normalize,
        )
        call = self._embedding.Embed
        return self._call(call, request, embeddings_from_proto, timeout, request_id)

    # --- tokenization ----------------------------------------------------------------------

    def tokenize(
        self,
        text: str | None = None,
        *,
        messages: ChatMessages | None = None,
        add_special_tokens: bool | None = None,
        model: str | None = None,
        timeout: float | None = None,
        chat_options: ChatOptions | None = None,
    ) -> types.Tokens:
        """Token ids of ``text``, or of chat ``messages`` rendered with the chat template."""
        request = requests.tokenize_request(
            text,
            messages=messages,
            model=self._model(model),
            add_special_tokens=add_special_tokens,
            chat_options=chat_options,
        )
        return self._call(self._tokenization.Tokenize, request, types.tokens_from_proto, timeout)

    def detokenize(
        self,
        token_ids: Iterable[int],
        *,
        skip_special_tokens: bool | None = None,
        model: str | None = None,
        timeout: float | None = None,
    ) -> str:
        request = requests.detokenize_request(
            list(token_ids), model=self._model(model), skip_special_tokens=skip_special_tokens
        )
        return self._call(self._tokenization.Detokenize, request, _text, timeout)

    # --- administration --------------------------------------------------------------------

    def models(self, *, timeout: float | None = None) -> list[types.ModelCard]:
        """The served models, the default first."""
        request = admin_pb2.ListModelsRequest()
        return self._call(self._admin.ListModels, request, types.models_from_proto, timeout)

    def server_info(self, *, timeout: float | None = None) -> types.ServerInfo:
        request = admin_pb2.GetServerInfoRequest()
        return self._call(self._admin.GetServerInfo, request, types.server_info_from_proto, timeout)

    def model_info(
        self, model: str | None = None, *, timeout: float | None = None
    ) -> types.ModelInfo:
        request = admin_pb2.GetModelInfoRequest(model=self._model(model))
        return self._call(self._admin.GetModelInfo, request, types.model_info_from_proto, timeout)

    def abort(self, *request_ids: str, timeout: float | None = None) -> list[str]:
        """Abort requests by id; returns those that were still running or queued."""
        request = admin_pb2.AbortRequest(request_ids=request_ids)
        return self._call(self._admin.Abort, request, _aborted_ids, timeout)

    def load(self, *, timeout: float | None = None) -> types.Load:
        """Requests running and waiting, KV cache usage, prefix hit rate, recent throughput."""
        request = admin_pb2.GetLoadRequest()
        return self._call(self._admin.GetLoad, request, types.load_from_proto, timeout)

    def reset_prefix_cache(self, *, timeout: float | None = None) -> None:
        """Forget every cached prefix; FAILED_PRECONDITION while requests hold cache blocks."""
        request = admin_pb2.ResetPrefixCacheRequest()
        return self._call(self._admin.ResetPrefixCache, request, _nothing, timeout)

    def sleep(self, level: int | None = None, *, timeout: float | None = None) -> None:
        """Free memory while idle (server started with --enable-sleep-mode): level 1 drops the
        KV cache, 2 the weights too. Generation fails with FAILED_PRECONDITION until
        ``wake_up``."""
        request = admin_pb2.SleepRequest(level=level)
        return self._call(self._admin.Sleep, request, _nothing, timeout)

    def wake_up(self, *, timeout: float | None = None) -> None:
        """Restore what ``sleep`` freed; a no-op when awake. FAILED_PRECONDITION, as ``sleep``,
        from a server started without --enable-sleep-mode."""
        request = admin_pb2.WakeUpRequest()
        return self._call(self._admin.WakeUp, request, _nothing, timeout)

    def is_sleeping(self, *, timeout: float | None = None) -> bool:
        request = admin_pb2.IsSleepingRequest()
        return self._call(self._admin.IsSleeping, request, _is_sleeping, timeout)

    def load_lora_adapter(
        self,
        name: str,
        path: str,
        *,
        base_model_name: str = "",
        timeout: float | None = None,
    ) -> types.LoraAdapter:
        """Load the PEFT adapter in the server's folder ``path`` as ``name`` (admin key; a
        server with --enable-lora). Requests then use it with ``lora=name``."""
        request = admin_pb2.LoadLoraAdapterRequest(
            lora_name=name, lora_path=path, base_model_name=base_model_name
        )
        return self._call(self._admin.LoadLoraAdapter, request, _loaded_adapter, timeout)

    def unload_lora_adapter(self, name: str, *, timeout: float | None = None) -> None:
        """Unload an adapter; requests already running with it finish."""
        request = admin_pb2.UnloadLoraAdapterRequest(lora_name=name)
        return self._call(self._admin.UnloadLoraAdapter, request, _nothing, timeout)

    def lora_adapters(self, *, timeout: float | None = None) -> list[types.LoraAdapter]:
        request = admin_pb2.ListLoraAdaptersRequest()
        return self._call(self._admin.ListLoraAdapters, request, _adapters, timeout)

    def health(self, service: str = "", *, timeout: float | None = None) -> str:
        """The standard health check: "SERVING" once the model is loaded, else "NOT_SERVING".

        ``service`` "" is the whole server; a service's full name asks about that service.
        """
        request = health_pb2.HealthCheckRequest(service=service)
        return self._call(self._health.Check, request, _serving_status, timeout)

    # --- implemented by Client and AsyncClient ---------------------------------------------

    def _open_channel(self):
        raise NotImplementedError

    def _call(self, method, request, convert, timeout, request_id=None):
        raise NotImplementedError

    def _stream(self, request, timeout, request_id):
        raise NotImplementedError


def _nothing(response) -> None:
    return None


def _is_sleeping(response: admin_pb2.IsSleepingResponse) -> bool:
    return response.is_sleeping


def _loaded_adapter(response: admin_pb2.LoadLoraAdapterResponse) -> types.LoraAdapter:
    return types.lora_adapter_from_proto(response.adapter)


def _adapters(response: admin_pb2.ListLoraAdaptersResponse) -> list[types.LoraAdapter]:
    return [types.lora_adapter_from_proto(adapter) for adapter in response.adapters]


def _text(response) -> str:
    return response.text


def _aborted_ids(response: admin_pb2.AbortResponse) -> list[str]:
    return list(response.aborted_request_ids)


def _serving_status(response: health_pb2.HealthCheckResponse) -> str:
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
