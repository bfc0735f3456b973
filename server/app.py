"""Building and running the grpc.aio server: v1 services, health, reflection, graceful stop.

The port is bound first and health says NOT_SERVING while the model loads and warms up, so
probes and ``grpcurl list`` work at once; health turns SERVING once the engine has served a
warm-up request, and NOT_SERVING for good when the server stops or the engine dies.
"""

from __future__ import annotations

import asyncio
import logging
import signal

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from llmrpc.engine.async_engine import AsyncEngine
from llmrpc.engine.config import EngineConfig
from llmrpc.server.servicers import SERVICE_NAMES, ServerState, add_services
from llmrpc.server.settings import FrontendConfig, effective_config, grpc_bind_address

logger = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 10.0  # in-flight calls get this long to finish on SIGTERM
HEALTH_SERVICE_NAME = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
_SERVER_OPTIONS = (
    # gRPC sets SO_REUSEPORT by default: a second server on the same port would bind silently
    # and steal half the connections. Fail loudly instead.
    ("grpc.so_reuseport", 0),
)


class BindError(RuntimeError):
    """The gRPC port could not be bound (in use, or a bad address)."""


class RunningServer:
    """A started gRPC server and, once loaded, its engine."""

    def __init__(self, server: grpc.aio.Server, state: ServerState, port: int, host: str) -> None:
        self.server = server
        self.state = state
        self.port = port
        self.host = host
        self.health = health.aio.HealthServicer()
        self.engine_failure: BaseException | None = None
        self.engine_died = asyncio.Event()
        self._stopped = False

    @property
    def engine(self) -> AsyncEngine | None:
        return self.state.engine

    @property
    def address(self) -> str:
        """A ``host:port`` a client on this machine can dial."""
        host = self.host if self.host not in ("", "[::]", "0.0.0.0") else "localhost"
        return f"{host}:{self.port}"

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for service in ("", *SERVICE_NAMES):
            await self.health.set(service, status)

    async def load(self, engine_config: EngineConfig, frontend: FrontendConfig) -> None:
        """Load the model, warm it up, then report SERVING."""
        engine = await AsyncEngine.create(engine_config)
        self.state.engine = engine
        engine.on_dead.append(self._on_engine_dead)
        self.state.effective_config.update(
            effective_config(engine_config, frontend, self.port, engine.model_info)
        )
        await engine.warmup()
        await self.set_serving(True)
        names = ", ".join(engine.model_info.served_model_names)
        logger.info("serving %s on gRPC port %d", names, self.port)

    def _on_engine_dead(self, error: BaseException) -> None:
        logger.error("the engine died; the server stops: %r", error)
        self.engine_failure = error
        self.engine_died.set()
        asyncio.get_running_loop().create_task(self.health.enter_graceful_shutdown())

    async def stop(self, grace: float | None = SHUTDOWN_GRACE_S) -> None:
        """Health NOT_SERVING, let in-flight calls finish for ``grace`` seconds, stop the engine."""
        if self._stopped:
            return
        self._stopped = True
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)
        if self.state.engine is not None:
            await self.state.engine.shutdown()
        logger.info("server stopped")


async def bind_server(engine_config: EngineConfig, frontend: FrontendConfig) -> RunningServer:
    """Start a gRPC server on ``frontend``'s address with every service; NOT_SERVING for now."""
    server = grpc.aio.server(options=_SERVER_OPTIONS)
    state = ServerState(extra_services=(HEALTH_SERVICE_NAME, reflection.SERVICE_NAME))
    add_services(server, state)
    address = grpc_bind_address(frontend.host, frontend.grpc_port)
    try:
        port = server.add_insecure_port(address)
    except RuntimeError as error:
        raise BindError(
            f"--grpc-port {frontend.grpc_port}: cannot listen on {address}: the port is in use "
            "or the address is not one of this machine's"
        ) from error
    running = RunningServer(server, state, port, frontend.host or "[::]")
    health_pb2_grpc.add_HealthServicer_to_server(running.health, server)
    reflection.enable_server_reflection(
        (*SERVICE_NAMES, HEALTH_SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    state.effective_config.update(effective_config(engine_config, frontend, port))
    await running.set_serving(False)
    await server.start()
    logger.info(
        "gRPC server listening on %s (not serving until the model is ready)",
        grpc_bind_address(frontend.host, port),
    )
    return running


async def start_server(
    engine_config: EngineConfig, host: str = "127.0.0.1", port: int = 0
) -> RunningServer:
    """Start a server and load its model; returns once health says SERVING (for tests, embedding).

    ``port`` 0 lets the OS choose; read the port chosen from ``RunningServer.port``.
    """
    frontend = FrontendConfig(host=host, grpc_port=port)
    running = await bind_server(engine_config, frontend)
    try:
        await running.load(engine_config, frontend)
    except BaseException:
        await running.stop(grace=0)
        raise
    return running


async def serve(engine_config: EngineConfig, frontend: FrontendConfig) -> int:
    """Run until SIGTERM/SIGINT (exit status 0), the engine dies (1) or loading fails (1, or 2
    for a bad flag value)."""
    running = await bind_server(engine_config, frontend)
    stop_requested = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, _on_signal, signum, stop_requested, running)
    try:
        load = asyncio.create_task(running.load(engine_config, frontend))
        waits = [asyncio.create_task(e.wait()) for e in (stop_requested, running.engine_died)]
        await asyncio.wait([load, *waits], return_when=asyncio.FIRST_COMPLETED)
        if load.done() and not load.exception():
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for task in (load, *waits):
            task.cancel()
        await asyncio.wait([load, *waits])  # never raises: outcomes are read below
        await running.stop()
        return _exit_code(load, running)
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)


def _on_signal(signum: int, stop_requested: asyncio.Event, running: RunningServer) -> None:
    name = signal.Signals(signum).name
    if not stop_requested.is_set():
        logger.info("%s received: stopping gracefully (send it again to stop at once)", name)
        stop_requested.set()
    else:
        logger.warning("%s received again: cancelling the calls in flight", name)
        asyncio.get_running_loop().create_task(running.server.stop(None))


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
