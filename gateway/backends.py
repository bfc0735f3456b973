"""The gRPC replicas behind the gateway: one ``AsyncClient`` each, their health watched.

Each replica's ``grpc.health.v1`` Watch stream says whether it is SERVING; requests go to the
serving replica with the fewest calls in flight (in turn on a tie), so a replica that turns
NOT_SERVING (loading, draining) stops getting new requests at once while another serves. While
none serves, a replica that answers NOT_SERVING still gets them, and answers for itself: one
draining after SIGTERM serves them until its --drain-delay ends (as it does gRPC calls; the
in-process replica of ``llmrpc serve`` is this case, its REST following its gRPC drain), one
loading or stopping says UNAVAILABLE with its reason. A replica that cannot be reached gets
none, and is watched again after a short pause.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Mapping

import grpc

from llmrpc.clients import AsyncClient, LlmrpcError, RetryPolicy
from llmrpc.gateway.settings import BackendSettings

logger = logging.getLogger(__name__)

REWATCH_DELAY_S = 0.5


class Backend:
    """One replica: its client, whether it serves, whether it answers, its calls in flight."""

    def __init__(self, target: str, client: AsyncClient) -> None:
        self.target = target
        self.client = client
        self.serving = False  # its health says SERVING
        self.answering = False  # its health Watch is open (SERVING or NOT_SERVING)
        self.in_flight = 0

    async def watch(self) -> None:
        """Follow the replica's health until cancelled."""
        while True:
            try:
                async for status in self.client.watch_health():
                    self._set_status(status == "SERVING", answering=True)
            except LlmrpcError as error:
                logger.debug("health watch of %s ended: %s", self.target, error)
            self._set_status(False, answering=False)
            await asyncio.sleep(REWATCH_DELAY_S)

    def _set_status(self, serving: bool, answering: bool) -> None:
        if (serving, answering) != (self.serving, self.answering):
            logger.info("gRPC replica %s is %s", self.target, _describe(serving, answering))
        self.serving, self.answering = serving, answering


def _describe(serving: bool, answering: bool) -> str:
    if serving:
        return "up"
    if answering:
        return "not serving (loading or draining): it gets calls only while no replica serves"
    return "down"


class NoBackendError(LlmrpcError):
    def __init__(self, targets: list[str]) -> None:
        message = f"no gRPC replica is serving ({', '.join(targets)})"
        super().__init__(grpc.StatusCode.UNAVAILABLE, message)


class BackendPool:
    """The replicas and their health watchers; ``start`` and ``close`` on the serving loop."""

    def __init__(self, settings: BackendSettings, channels: Mapping | None = None) -> None:
        """``channels``: open channels to use for some targets (the in-process one of the
        server running this gateway); the others are dialled."""
        self.settings = settings
        self._channels = dict(channels or {})
        self.backends: list[Backend] = []
        self._watchers: list[asyncio.Task] = []
        self._default_model: str | None = None
        self._turn = 0

    def _client(self, target: str) -> AsyncClient:
        s = self.settings
        return AsyncClient(
            target,
            tls=s.tls,
            ca_cert=s.ca_certs,
            client_cert=s.client_cert,
            client_key=s.client_key,
            server_name=s.server_name,
            api_key=s.api_key,
            retry=RetryPolicy(max_attempts=1),  # the pool fails over instead
            channel=self._channels.get(target),
        )

    async def start(self) -> None:
        self.backends = [Backend(t, self._client(t)) for t in self.settings.targets]
        self._watchers = [asyncio.create_task(b.watch()) for b in self.backends]

    async def close(self) -> None:
        for task in self._watchers:
            task.cancel()
        for task in self._watchers:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for backend in self.backends:
            await backend.client.close()

    @property
    def serving(self) -> list[Backend]:
        return [b for b in self.backends if b.serving]

    def pick(self, exclude: tuple[Backend, ...] = ()) -> Backend:
        """The serving replica with the fewest calls in flight, ties taken in turn; while none
        serves, one that answers NOT_SERVING (draining, it still serves; else it says why not)."""
        self._turn = (self._turn + 1) % len(self.backends)
        rotated = self.backends[self._turn :] + self.backends[: self._turn]
        candidates = [b for b in rotated if b.serving and b not in exclude]
        if not candidates:
            candidates = [b for b in rotated if b.answering and b not in exclude]
        if not candidates:
            raise NoBackendError([b.target for b in self.backends])
        return min(candidates, key=lambda b: b.in_flight)

    async def call(self, method: str, *args, **kwargs):
        """``AsyncClient.method(*args, **kwargs)`` on a serving replica; on UNAVAILABLE, the
        next serving one."""
        tried: tuple[Backend, ...] = ()
        while True:
            backend = self.pick(tried)
            backend.in_flight += 1
            try:
                return await getattr(backend.client, method)(*args, **kwargs)
            except LlmrpcError as error:
                if error.code != grpc.StatusCode.UNAVAILABLE:
                    raise
                tried += (backend,)
                if not self._has_untried(tried):
                    raise
            finally:
                backend.in_flight -= 1

    async def stream(self, method: str, *args, **kwargs) -> AsyncIterator:
        """The deltas of ``AsyncClient.method`` (``stream``/``chat_stream``) from one replica;
        fails over on UNAVAILABLE before the first delta."""
        tried: tuple[Backend, ...] = ()
        while True:
            backend = self.pick(tried)
            backend.in_flight += 1
            received = False
            try:
                async for delta in getattr(backend.client, method)(*args, **kwargs):
                    received = True
                    yield delta
                return
            except LlmrpcError as error:
                tried += (backend,)
                retry = not received and error.code == grpc.StatusCode.UNAVAILABLE
                if not (retry and self._has_untried(tried)):
                    raise
            finally:
                backend.in_flight -= 1

    def _has_untried(self, tried: tuple[Backend, ...]) -> bool:
        return any(b not in tried for b in self.backends if b.serving or b.answering)

    async def default_model(self) -> str:
        """The served name of the replicas' default model (asked once)."""
        if self._default_model is None:
            self._default_model = (await self.call("models"))[0].id
        return self._default_model
