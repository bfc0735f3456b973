"""grpc.health.v1 for the server ("") and each service, and the plaintext health-only port.

Kubernetes gRPC probes cannot use TLS, so with ``--health-port`` a second, plaintext server
answers health alone, from the same servicer: both ports always report the same status.

``watch_for_stalls`` turns health NOT_SERVING while the engine is stalled (``--engine-stall-
timeout``: requests in flight and no step for that long; idle, no report for that long, 5 s at
least) and SERVING again when it steps; the REST gateway's /health follows, as it follows any
change of the gRPC health.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from llmrpc.server.settings import BindError, grpc_bind_address

logger = logging.getLogger(__name__)

HEALTH_SERVICE_NAME = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class _HealthServicer(health.aio.HealthServicer):
    """Ends its Watch streams (status OK) on ``end_watches``: left open, they would hold a
    stopping server for its whole grace period."""

    def __init__(self) -> None:
        super().__init__()
        self._ended = asyncio.Event()

    async def Watch(self, request, context) -> None:
        watching = asyncio.ensure_future(super().Watch(request, context))
        ending = asyncio.ensure_future(self._ended.wait())
        try:
            await asyncio.wait((watching, ending), return_when=asyncio.FIRST_COMPLETED)
        finally:
            watching.cancel()
            ending.cancel()

    def end_watches(self) -> None:
        self._ended.set()


class Health:
    """The health servicer and the services it reports on."""

    def __init__(self, services: tuple[str, ...]) -> None:
        self.servicer = _HealthServicer()
        self.services = ("", *services)
        self.serving = False  # what the server reports now (ServerReady of KServe v2 too)
        self._shut_down = False
        # set once the server starts stopping: streams that would never end (KV events) end
        self.stopping = asyncio.Event()

    async def set_serving(self, serving: bool) -> None:
        """SERVING or NOT_SERVING for all; Watch streams see the change at once."""
        self.serving = serving and not self._shut_down
        for service in self.services:
            await self.servicer.set(service, SERVING if serving else NOT_SERVING)

    async def shut_down(self) -> None:
        """NOT_SERVING for good: later ``set_serving`` calls change nothing."""
        self.serving, self._shut_down = False, True
        self.stopping.set()
        await self.servicer.enter_graceful_shutdown()

    def end_watches(self) -> None:
        """End every Watch stream, once nothing else holds the stopping server."""
        self.servicer.end_watches()

    async def watch_for_stalls(self, engine) -> None:
        """Until cancelled: NOT_SERVING while ``engine.stalled``, SERVING again once it is not
        (nothing changes once ``shut_down``). Checked every quarter of the bound, 1 s at most."""
        period = min(1.0, engine.stall_timeout_s / 4)
        stalled_since = None
        while engine.dead_error is None:  # dead: health is NOT_SERVING for good
            await asyncio.sleep(period)
            stalled = engine.stalled and engine.dead_error is None
            if stalled and stalled_since is None:
                stalled_since = time.monotonic()
                in_flight = engine.num_requests_in_flight
                logger.warning(
                    "the engine has not %s for %.1f s (--engine-stall-timeout %g s): health is "
                    "NOT_SERVING until it steps again",
                    f"stepped with {in_flight} request(s) in flight" if in_flight else "reported",
                    engine.figures_age_s,
                    engine.stall_timeout_s,
                )
                await self.set_serving(False)
            elif not stalled and stalled_since is not None:
                logger.info(
                    "the engine steps again after %.1f s stalled: health is SERVING",
                    time.monotonic() - stalled_since,
                )
                stalled_since = None
                await self.set_serving(True)

    def add_to(self, server: grpc.aio.Server) -> None:
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)

    async def start_plaintext_port(
        self, host: str | None, port: int, options=(), interceptors=()
    ) -> tuple[grpc.aio.Server, int]:
        """A server answering health alone on ``host:port`` (0: the OS chooses), with the main
        port's transport ``options`` and ``interceptors`` (its limits hold here too)."""
        server = grpc.aio.server(
            options=[("grpc.so_reuseport", 0), *options], interceptors=interceptors
        )
        self.add_to(server)
        address = grpc_bind_address(host, port)
        try:
            bound = server.add_insecure_port(address)
        except RuntimeError as error:
            raise BindError(f"--health-port {port}: cannot listen on {address}") from error
        await server.start()
        logger.info(
            "health alone, in plaintext, on %s (--health-port)", grpc_bind_address(host, bound)
        )
        return server, bound
