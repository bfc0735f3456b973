"""Transport limits as gRPC channel arguments, and the bound on the waiting queue.

gRPC ignores channel-argument names it does not know, silently, so these names are the real
ones from gRPC core (grpc_types.h); tests/server/test_limits.py shows each takes effect.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from llmrpc.common.fd_limit import default_max_connections
from llmrpc.server.errors import InvalidArgument, ResourceExhausted
from llmrpc.server.settings import LimitsConfig

# How long a client refused for a full queue should wait before retrying.
RETRY_DELAY_S = 1.0


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


def channel_options(limits: LimitsConfig) -> list[tuple[str, int]]:
    options = [
        # gRPC sets SO_REUSEPORT by default: a second server on the same port would bind
        # silently and steal half the connections. Fail loudly instead.
        ("grpc.so_reuseport", 0),
        ("grpc.max_receive_message_length", limits.max_receive_message_size),
        ("grpc.max_send_message_length", limits.max_send_message_size),
        ("grpc.keepalive_time_ms", _ms(limits.keepalive_time_s)),
        ("grpc.keepalive_timeout_ms", _ms(limits.keepalive_timeout_s)),
        # Clients may keep idle connections alive with pings, no more often than this.
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", _ms(limits.min_ping_interval_s)),
    ]
    if limits.max_connection_age_s is not None:
        options.append(("grpc.max_connection_age_ms", _ms(limits.max_connection_age_s)))
    if limits.max_connection_age_grace_s is not None:
        grace = _ms(limits.max_connection_age_grace_s)
        options.append(("grpc.max_connection_age_grace_ms", grace))
    max_connections = limits.max_connections or default_max_connections()
    options += [
        ("grpc.max_concurrent_streams", limits.max_concurrent_streams),
        # Count streams as HTTP/2 does (open ones), which clients track and wait on; gRPC core
        # otherwise counts streams not yet freed and refuses (REFUSED_STREAM, UNAVAILABLE to
        # the caller) what the client believed it could send (seen: 1,238 of a burst of 2,000).
        ("grpc.http.overload_protection", 0),
        # Refused at accept, before any handshake: the port's file descriptors stay bounded.
        ("grpc.max_allowed_incoming_connections", max_connections),
        # A connection that never finishes its TLS and HTTP/2 handshake is closed (core: 120 s).
        ("grpc.server_handshake_timeout_ms", _ms(limits.handshake_timeout_s)),
    ]
    return options


class AdmissionControl:
    """Bounds the samples waiting for a place in the engine's batch.

    A request for n samples takes n places: the engine runs each sample as a sequence of its
    own. Samples in flight are counted here (the event loop is single-threaded, so the count is
    exact); those the engine is not running are waiting, including ones on their way in and,
    until their request ends, samples that have already finished (a conservative count).
    """

    def __init__(self, max_waiting: int | None) -> None:
        self.max_waiting = max_waiting
        self.num_in_flight = 0

    @contextlib.contextmanager
    def admit(self, engine, num_samples: int = 1) -> Iterator[None]:
        """Hold places for one request's samples; ResourceExhausted if the queue is full."""
        if self.max_waiting is not None:
            self._check_room(engine, num_samples)
        self.num_in_flight += num_samples
        try:
            yield
        finally:
            self.num_in_flight -= num_samples

    def _check_room(self, engine, num_samples: int) -> None:
        if 0 < self.max_waiting < num_samples:  # retrying would never help: the client's error
            raise InvalidArgument(
                "sampling.n",
                f"at most {self.max_waiting} samples on this server (--max-waiting-requests)",
            )
        num_waiting = self.num_in_flight - engine.stats.num_running
        if num_waiting + num_samples > self.max_waiting:
            raise ResourceExhausted(
                f"the server's waiting queue is full ({self.max_waiting} samples, "
                "--max-waiting-requests); retry later",
                retry_after_s=RETRY_DELAY_S,
            )
