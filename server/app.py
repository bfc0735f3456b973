"""Building and running the grpc.aio server: v1 services, health, reflection, drain and stop.

The port is bound first and health says NOT_SERVING while the model loads and warms up, so
probes and ``grpcurl list`` work at once; health turns SERVING once the engine has served a
warm-up request. While the engine is stalled (``--engine-stall-timeout``: requests in flight
and no step for that long; ``server/health.py``) health says NOT_SERVING, and SERVING again
once it steps. On SIGTERM health turns NOT_SERVING at once; calls are still served for the
drain delay (load balancers stop routing here meanwhile), then the server stops: calls in
flight get the shutdown grace to finish, new ones get UNAVAILABLE, and the engine stops (its
process, unless --disable-frontend-multiprocessing keeps it on a thread here). Once the engine
has loaded, the server loads its own tokenizers (one set, whatever the number of engines:
``server/tokenization.py``); the engine receives token ids. If the engine dies (its step loop
fails, or its process ends unasked), the calls waiting on it get UNAVAILABLE, health turns
NOT_SERVING and ``serve`` returns 1 with the cause logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable
from typing import Protocol

import grpc

from llmrpc.common.chat_template import read_chat_template
from llmrpc.engine.client.async_engine import AsyncEngine, EngineClient
from llmrpc.engine.client.data_parallel import DataParallelClient
from llmrpc.engine.client.process import EngineProcessClient
from llmrpc.engine.config import EngineConfig
from llmrpc.kserve import grpc_predict_v2_pb2_grpc
from llmrpc.server import model_paths, reflection
from llmrpc.server.admin import AdminServicer
from llmrpc.server.auth import KeyRing, RequestOwners
from llmrpc.server.embedding import EmbeddingServicer
from llmrpc.server.health import HEALTH_SERVICE_NAME, Health
from llmrpc.server.interceptors import ApiKeyInterceptor, CallsInFlight, RequestContextInterceptor
from llmrpc.server.kserve import InferenceServicer
from llmrpc.server.limits import AdmissionControl, channel_options
from llmrpc.server.logs import install_request_id_records, log_stats_forever
from llmrpc.server.loopback import HandlerRegistry, LoopbackChannel
from llmrpc.server.message_deadline import RequestMessageDeadline
from llmrpc.server.options import effective_config
from llmrpc.server.output_parsing import OutputParsers
from llmrpc.server.ports import check_can_listen
from llmrpc.server.servicers import GenerationServicer, TokenizationServicer
from llmrpc.server.settings import BindError, FrontendConfig, grpc_bind_address
from llmrpc.server.state import SERVICE_NAMES, ServerState
from llmrpc.server.tls import server_credentials
from llmrpc.server.tokenization import Tokenization, tokenizer_path
from llmrpc.server.tracing import ServerTracing
from llmrpc.server.vllm_engine import VllmEngineServicer
from llmrpc.v1 import (
    admin_pb2_grpc,
    embedding_pb2_grpc,
    generation_pb2_grpc,
    tokenization_pb2_grpc,
)
from llmrpc.vllm_engine import vllm_engine_pb2_grpc

logger = logging.getLogger(__name__)

# Health and reflection answer without an API key: probes and `grpcurl list` need none.
OPEN_SERVICES = (HEALTH_SERVICE_NAME, *reflection.SERVICE_NAMES)


class BesideService(Protocol):
    """A service ``serve`` runs beside the gRPC server, in its process and on its event loop (the
    REST gateway of ``llmrpc serve``). It is built, with the in-process channel it calls the
    server through, before any port is bound; ``bind`` takes its port (BindError); ``start``
    serves; ``stop`` stops it whether or not it started."""

    def bind(self) -> None: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


class RunningServer:
    """A gRPC server with every service, its port once bound, and, once loaded, its engine."""

    def __init__(
        self,
        server: grpc.aio.Server,
        state: ServerState,
        health: Health,
        calls: CallsInFlight,
        host: str,
        loopback: LoopbackChannel,
    ) -> None:
        self.server = server
        self.state = state
        self.health = health
        self.calls = calls
        self.port: int | None = None  # set once bound
        self.host = host
        self.health_server: grpc.aio.Server | None = None  # the plaintext health-only port
        self.health_port: int | None = None
        self.loopback = loopback  # the in-process channel the REST gateway calls through
        self.credentials: grpc.ServerCredentials | None = None  # TLS, checked before binding
        self.engine_failure: BaseException | None = None
        self.engine_died = asyncio.Event()
        self._stats_task: asyncio.Task | None = None
        self._stall_task: asyncio.Task | None = None
        self._hurry = asyncio.Event()
        self._stopped = False
        self.tracing: ServerTracing | None = None  # --otlp-traces-endpoint

    @property
    def engine(self) -> EngineClient | None:
        return self.state.engine

    @property
    def tokenization(self) -> Tokenization | None:
        """The frontend's tokenizers (``server/tokenization.py``), once loaded."""
        return self.state.tokenization

    @property
    def address(self) -> str:
        """A ``host:port`` a client on this machine can dial."""
        host = self.host if self.host not in ("", "[::]", "0.0.0.0") else "localhost"
        return f"{host}:{self.port}"

    async def load(self, engine_config: EngineConfig, frontend: FrontendConfig) -> None:
        """Start the engine (in its own process unless --disable-frontend-multiprocessing) and
        load the model, load the frontend's tokenizers, warm up, then report SERVING."""
        engine_config = model_paths.engine_config_for(engine_config, frontend.hide_model_path)
        if frontend.disable_frontend_multiprocessing:
            engine: EngineClient = await AsyncEngine.create(engine_config)
        elif frontend.data_parallel_size > 1:
            engine = await DataParallelClient.create(engine_config, frontend.data_parallel_size)
        else:
            engine = await EngineProcessClient.create(engine_config)
        try:
            tokenization = await _load_tokenization(engine_config, engine.model_info, frontend)
        except BaseException:
            await engine.shutdown()
            raise
        self.state.tokenization = tokenization
        self.state.tokenizer_path = tokenizer_path(engine_config, engine.model_info)
        self.state.engine = engine
        engine.on_dead.append(self._on_engine_dead)
        self.state.effective_config.update(_engine_facts(engine.model_info))
        if frontend.hide_model_path:
            config = model_paths.hidden_config(self.state.effective_config, engine_config)
            self.state.effective_config.update(config)
        await engine.warmup(_warmup_prompt(tokenization.tokenizer))
        if not frontend.logs.disable_log_stats:
            interval = frontend.logs.stats_interval_s
            self._stats_task = asyncio.create_task(log_stats_forever(engine, interval))
        engine.stall_timeout_s = frontend.engine_stall_timeout_s
        self._stall_task = asyncio.create_task(self.health.watch_for_stalls(engine))
        await self.health.set_serving(True)
        names = ", ".join(engine.model_info.served_model_names)
        logger.info("serving %s on gRPC port %d", names, self.port)

    def _on_engine_dead(self, error: BaseException) -> None:
        logger.error("the engine died; the server stops: %r", error)
        self.engine_failure = error
        self.engine_died.set()
        asyncio.get_running_loop().create_task(self.health.shut_down())

    async def stop(self, grace: float | None = 0, drain_delay: float = 0.0) -> None:
        """NOT_SERVING at once; serve on for ``drain_delay`` seconds; then let calls in flight
        finish for ``grace`` seconds (None: as long as they take) while refusing new ones."""
        if self._stopped:
            return
        self._stopped = True
        if self.port is None:  # never bound: nothing serves, nothing to drain
            await self._end_tracing()
            return
        await self.health.shut_down()
        await self._drain(drain_delay)
        await self._stop_serving(grace)
        for task in (self._stats_task, self._stall_task):
            if task is not None:
                task.cancel()
        if self.state.engine is not None:
            await self.state.engine.shutdown()
        if self.state.tokenization is not None:
            self.state.tokenization.shutdown()
        await self._end_tracing()
        logger.info("server stopped")

    async def _end_tracing(self) -> None:
        """Export the spans still buffered (those of the calls that ended while draining)."""
        if self.tracing is not None:
            await self.tracing.shutdown()

    async def _drain(self, delay: float) -> None:
        if delay > 0:
            logger.info("draining for %.1f s: health is NOT_SERVING, calls are still served", delay)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._hurry.wait(), delay)

    async def _stop_serving(self, grace: float | None) -> None:
        logger.info("stopping: calls in flight get %s s to finish, new calls are refused", grace)
        # One stop call only: concurrent stop calls race inside grpc.aio (a crash, seen).
        stopping = asyncio.gather(self.server.stop(grace), self.loopback.stop(grace))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.calls.wait_idle(), grace)
        self.health.end_watches()
        await stopping
        if self.health_server is not None:
            await self.health_server.stop(None)

    def hurry(self) -> None:
        """End the drain delay and the calls in flight at once (a second SIGTERM)."""
        self._hurry.set()
        self.calls.cut_all()


async def _load_tokenization(engine_config, model_info, frontend: FrontendConfig) -> Tokenization:
    """One tokenizer set for the frontend, whatever the number of engines; with --chat-template,
    rendering with that template."""
    tokenization = await Tokenization.load(tokenizer_path(engine_config, model_info))
    try:
        if frontend.chat_template is not None:
            tokenization.set_chat_template(read_chat_template(frontend.chat_template))
    except BaseException:
        tokenization.shutdown()
        raise
    return tokenization


def _warmup_prompt(tokenizer) -> list[int]:
    """The warm-up request's prompt: "Hello" in the model's tokens (none without a tokenizer)."""
    return tokenizer.encode("Hello", add_special_tokens=False) if tokenizer is not None else []


def _engine_facts(model_info) -> dict[str, str]:
    """Values the engine resolved while loading, for GetServerInfo's configuration."""
    return {
        "served_model_name": ",".join(model_info.served_model_names),
        "dtype": model_info.dtype,
        "max_model_len": str(model_info.max_model_len),
        "num_kv_blocks": str(model_info.num_kv_blocks),
    }


def _interceptors(
    frontend: FrontendConfig,
    calls: CallsInFlight,
    owners: RequestOwners,
    tracing: ServerTracing | None = None,
) -> list:
    interceptors: list[grpc.aio.ServerInterceptor] = [
        RequestContextInterceptor(SERVICE_NAMES, calls, owners)
    ]
    if tracing is not None:  # inside the request-id interceptor: its spans know the id
        interceptors.append(tracing.interceptor(SERVICE_NAMES))
    if frontend.api_key or frontend.admin_api_key:
        keys = KeyRing(frontend.api_key, frontend.admin_api_key)
        interceptors.insert(0, ApiKeyInterceptor(keys, OPEN_SERVICES))
    return interceptors


def _on_the_network(interceptors: list, limits) -> list:
    """The network server's chain: the in-process one with the request-message deadline just
    inside the key check, so a call with a refused key ends before its message is read."""
    position = 1 if interceptors and isinstance(interceptors[0], ApiKeyInterceptor) else 0
    deadline = RequestMessageDeadline(limits.request_message_timeout_s)
    return [*interceptors[:position], deadline, *interceptors[position:]]


def _add_services(servers, state: ServerState, health: Health) -> None:
    """The services, on the network server and the in-process channel's registry alike."""
    generation = GenerationServicer(state)
    embedding = EmbeddingServicer(state)
    services = (
        (generation_pb2_grpc.add_GenerationServiceServicer_to_server, generation),
        (
            tokenization_pb2_grpc.add_TokenizationServiceServicer_to_server,
            TokenizationServicer(state),
        ),
        (admin_pb2_grpc.add_AdminServiceServicer_to_server, AdminServicer(state)),
        (embedding_pb2_grpc.add_EmbeddingServiceServicer_to_server, embedding),
        (
            grpc_predict_v2_pb2_grpc.add_GRPCInferenceServiceServicer_to_server,
            InferenceServicer(state, generation, health),
        ),
        (
            vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server,
            VllmEngineServicer(state, generation, embedding, health),
        ),
    )
    for server in servers:
        for add, servicer in services:
            add(servicer, server)
        health.add_to(server)
    reflection.add_reflection((*SERVICE_NAMES, HEALTH_SERVICE_NAME), servers[0])


def _add_port(running: RunningServer, frontend: FrontendConfig) -> int:
    address = grpc_bind_address(frontend.host, frontend.grpc_port)
    try:
        if running.credentials is not None:
            return running.server.add_secure_port(address, running.credentials)
        return running.server.add_insecure_port(address)
    except RuntimeError as error:
        raise BindError(
            f"--grpc-port {frontend.grpc_port}: cannot listen on {address}: the port is in use "
            "or the address is not one of this machine's"
        ) from error


def _warn_if_open(frontend: FrontendConfig) -> None:
    if not frontend.api_key and not frontend.tls.enabled:
        logger.warning(
            "no --api-key and no TLS: any client that can reach this port can use the server, "
            "in plaintext"
        )


def build_server(engine_config: EngineConfig, frontend: FrontendConfig) -> RunningServer:
    """A gRPC server with every service and its in-process channel, bound to no port yet.

    Raises ValueError naming the flag for bad TLS files (read here).
    """
    install_request_id_records()
    state = ServerState(
        tls=frontend.tls.enabled,
        auth_required=bool(frontend.api_key),
        admin_auth_required=bool(frontend.admin_api_key),
        extra_services=OPEN_SERVICES,
        logs=frontend.logs,
        admission=AdmissionControl(
            frontend.limits.max_waiting_requests,
            frontend.limits.max_prompts_per_request,
            frontend.limits.max_sequences_per_request,
        ),
        trust_request_chat_template=frontend.trust_request_chat_template,
        hide_model_path=frontend.hide_model_path,
        lora_enabled=engine_config.lora.enabled,
        output_parsers=OutputParsers.from_config(frontend.parsing),
    )
    health = Health(SERVICE_NAMES)
    calls = CallsInFlight()
    tracing = ServerTracing(frontend.tracing) if frontend.tracing.enabled else None
    interceptors = _interceptors(frontend, calls, state.owners, tracing)
    server = grpc.aio.server(
        options=channel_options(frontend.limits),
        interceptors=_on_the_network(interceptors, frontend.limits),
    )
    registry = HandlerRegistry()
    _add_services((server, registry), state, health)
    loopback = LoopbackChannel(registry, interceptors)
    running = RunningServer(server, state, health, calls, frontend.host or "[::]", loopback)
    running.tracing = tracing
    if frontend.tls.enabled:
        running.credentials = server_credentials(frontend.tls)
    state.effective_config.update(effective_config(engine_config, frontend))
    return running


async def listen(running: RunningServer, frontend: FrontendConfig) -> None:
    """Bind ``running``'s ports and start it; health says NOT_SERVING for now.

    Raises BindError naming the flag if a port cannot be bound (asked of the operating system
    first, so gRPC core never reports the failure in its own words).
    """
    check_can_listen("--grpc-port", frontend.host, frontend.grpc_port)
    if frontend.health_port is not None:
        check_can_listen("--health-port", frontend.host, frontend.health_port)
    port = _add_port(running, frontend)
    running.port = port
    running.state.effective_config["grpc_port"] = str(port)
    await running.health.set_serving(False)
    await running.server.start()
    scheme = "TLS" if frontend.tls.enabled else "plaintext"
    logger.info(
        "gRPC server listening on %s (%s; not serving until the model is ready)",
        grpc_bind_address(frontend.host, port),
        scheme,
    )
    if frontend.health_port is not None:
        running.health_server, running.health_port = await running.health.start_plaintext_port(
            frontend.host,
            frontend.health_port,
            channel_options(frontend.limits),
            [RequestMessageDeadline(frontend.limits.request_message_timeout_s)],
        )
    _warn_if_open(frontend)


async def bind_server(engine_config: EngineConfig, frontend: FrontendConfig) -> RunningServer:
    """Start a gRPC server on ``frontend``'s address with every service; NOT_SERVING for now.

    Raises BindError if a port cannot be bound, ValueError naming the flag for bad TLS files.
    """
    running = build_server(engine_config, frontend)
    await listen(running, frontend)
    return running


async def start_server(
    engine_config: EngineConfig,
    host: str = "127.0.0.1",
    port: int = 0,
    frontend: FrontendConfig | None = None,
) -> RunningServer:
    """Start a server and load its model; returns once health says SERVING (for tests, embedding).

    ``port`` 0 lets the OS choose; read the port chosen from ``RunningServer.port``. A
    ``frontend`` replaces ``host`` and ``port``.
    """
    frontend = frontend or FrontendConfig(host=host, grpc_port=port)
    running = await bind_server(engine_config, frontend)
    try:
        await running.load(engine_config, frontend)
    except BaseException:
        await running.stop(grace=0)
        raise
    return running


BesideFactory = Callable[[LoopbackChannel], BesideService]


async def serve(
    engine_config: EngineConfig,
    frontend: FrontendConfig,
    beside: BesideFactory | None = None,
    signalled: list[int] | None = None,
) -> int:
    """Run until SIGTERM/SIGINT (exit status 0), the engine dies (1) or loading fails (1, or 2
    for a bad flag value). ``signalled``: such signals received before this started, which it
    acts on as if they came now.

    ``beside`` builds a service to run beside the server from its in-process channel (the REST
    gateway of ``llmrpc serve``); it is built before any port is bound and binds its own port
    before the server binds its; it listens from the start and stops after the server.
    """
    # The handlers first: a signal while the server is built or binds asks for a stop (else
    # asyncio.run's own SIGINT handler would cancel this task inside the gRPC server's start).
    stop_requested = asyncio.Event()
    built: list[RunningServer] = []  # the server a second signal hurries, once there is one
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, _on_signal, signum, stop_requested, built)
    for signum in signalled or ():
        _on_signal(signum, stop_requested, built)
    try:
        running = build_server(engine_config, frontend)
        built.append(running)
        service = beside(running.loopback) if beside is not None else None
        await _listen_beside(running, service, frontend)
        if stop_requested.is_set():  # while starting: no model to load
            await running.stop(grace=0)
            if service is not None:
                await service.stop()
            return 0
        load = asyncio.create_task(running.load(engine_config, frontend))
        waits = [asyncio.create_task(e.wait()) for e in (stop_requested, running.engine_died)]
        await asyncio.wait([load, *waits], return_when=asyncio.FIRST_COMPLETED)
        if load.done() and not load.exception():
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for task in (load, *waits):
            task.cancel()
        await asyncio.wait([load, *waits])  # never raises: outcomes are read below
        drain = frontend.drain_delay_s if running.engine_failure is None else 0.0
        await running.stop(frontend.shutdown_grace_s, drain_delay=drain)
        if service is not None:
            await service.stop()
        return _exit_code(load, running)
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)


async def _listen_beside(
    running: RunningServer, service: BesideService | None, frontend: FrontendConfig
) -> None:
    """Bind the service's port, then the server's; start both. On any failure nothing is left
    listening."""
    try:
        if service is not None:
            service.bind()
        await listen(running, frontend)
        if service is not None:
            await service.start()
    except BaseException:
        await running.stop(grace=0)
        if service is not None:
            await service.stop()
        raise


def _on_signal(signum: int, stop_requested: asyncio.Event, built: list[RunningServer]) -> None:
    name = signal.Signals(signum).name
    if not stop_requested.is_set():
        logger.info("%s received: stopping gracefully (send it again to stop at once)", name)
        stop_requested.set()
    else:
        logger.warning("%s received again: cancelling the calls in flight", name)
        for running in built:
            running.hurry()


def _exit_code(load: asyncio.Task, running: RunningServer) -> int:
    if running.engine_failure is not None:
        return 1
    if load.done() and not load.cancelled() and load.exception() is not None:
        error = load.exception()
        if isinstance(error, ValueError):  # a bad flag value found while loading: usage error
            logger.error("%s", error)
            return 2
        logger.error("loading the model failed", exc_info=error)
        return 1
    return 0
