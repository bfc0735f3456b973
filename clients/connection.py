"""How a client reaches a server: target, TLS files, API key, and the retry policy.

Shared by ``Client`` and ``AsyncClient`` (and the command-line client), so both accept the same
targets: ``host:port``, ``unix:/path`` (or ``unix:///path``), and ``grpc://host:port`` or
``grpcs://host:port`` (the latter turns TLS on). Giving a CA, a client certificate or
``tls=True`` also turns TLS on; without a CA the system's roots verify the server.
"""

from __future__ import annotations

import contextlib
import contextvars
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from llmrpc.clients.errors import REQUEST_ID_METADATA, LlmrpcError
from llmrpc.v1.headers import AUTHORIZATION, BATCH_ID, BATCH_SEQUENCES, CLIENT, bearer

API_KEY_METADATA = AUTHORIZATION

# The key calls made in this context carry instead of the client's own: a proxy (the REST
# gateway inside ``llmrpc serve``) sets its caller's, so the server authorizes that caller.
_acting_for: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "llmrpc_acting_for", default=None
)


@contextlib.contextmanager
def acting_for(api_key: str) -> Iterator[None]:
    """Calls made inside the block (in this task, or tasks it starts) carry ``api_key``."""
    token = _acting_for.set(api_key)
    try:
        yield
    finally:
        _acting_for.reset(token)


# W3C trace headers (traceparent, tracestate) that calls made in this context carry: the REST
# gateway sets its request span's, so the server's spans join the REST request's trace.
_trace_headers: contextvars.ContextVar[tuple[tuple[str, str], ...]] = contextvars.ContextVar(
    "llmrpc_trace_headers", default=()
)


@contextlib.contextmanager
def carrying_trace(headers: tuple[tuple[str, str], ...]) -> Iterator[None]:
    """Calls made inside the block (in this task, or tasks it starts) carry ``headers``."""
    token = _trace_headers.set(headers)
    try:
        yield
    finally:
        _trace_headers.reset(token)


# (batch id, sequences of the whole batch) that calls made in this context carry: the REST
# gateway sets it around the calls of one multi-prompt request (``llmrpc.v1.headers.BATCH_ID``).
_batch: contextvars.ContextVar[tuple[str, int] | None] = contextvars.ContextVar(
    "llmrpc_batch", default=None
)


@contextlib.contextmanager
def in_batch(batch_id: str, num_sequences: int) -> Iterator[None]:
    """Calls made inside the block (in this task, or tasks it starts) are parts of one request
    of ``num_sequences`` sequences in all, which the server admits to its queue whole."""
    token = _batch.set((batch_id, num_sequences))
    try:
        yield
    finally:
        _batch.reset(token)


# The REST client that calls made in this context are for (``llmrpc.v1.headers.CLIENT``).
_client: contextvars.ContextVar[str | None] = contextvars.ContextVar("llmrpc_client", default=None)


@contextlib.contextmanager
def made_for(client: str) -> Iterator[None]:
    """Calls made inside the block (in this task, or tasks it starts) say they are for
    ``client``, the REST connection the gateway serves."""
    token = _client.set(client)
    try:
        yield
    finally:
        _client.reset(token)


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with full jitter, for UNAVAILABLE only.

    Attempt ``n`` (from 1) waits a uniform random time in ``[0, min(max_backoff,
    initial_backoff * multiplier ** (n - 1))]`` before the next try; jitter keeps many clients
    from retrying in lockstep after a restart. A server's ``RetryInfo`` delay, when it sends
    one, is waited instead. ``max_attempts`` counts the first try.
    """

    max_attempts: int = 5
    initial_backoff: float = 0.1
    max_backoff: float = 5.0
    multiplier: float = 2.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, got {self.max_attempts}")

    def backoff(self, attempt: int, server_delay: float | None = None) -> float:
        if server_delay is not None:
            return server_delay
        ceiling = min(self.max_backoff, self.initial_backoff * self.multiplier ** (attempt - 1))
        return random.uniform(0, ceiling)


def retry_delay(
    policy: RetryPolicy, error: LlmrpcError, attempt: int, deadline: float | None
) -> float | None:
    """Seconds to wait before retrying after ``error`` on try ``attempt``; None: give up.

    Only UNAVAILABLE is retried (the server is starting, restarting or unreachable); every other
    code is an answer that retrying cannot change. No retry may outlive the call's deadline.
    """
    if error.code != grpc.StatusCode.UNAVAILABLE or attempt >= policy.max_attempts:
        return None
    delay = policy.backoff(attempt, error.details.retry_delay)
    if deadline is not None and time.monotonic() + delay >= deadline:
        return None
    return delay


def remaining(deadline: float | None) -> float | None:
    """Seconds left until ``deadline`` (a ``time.monotonic()`` value), at least a millisecond."""
    return None if deadline is None else max(deadline - time.monotonic(), 0.001)


def deadline_of(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


@dataclass(frozen=True)
class ConnectionOptions:
    """Where and how to connect; see the module docstring for the target forms."""

    target: str = "localhost:50051"
    tls: bool = False
    ca_cert: str | Path | None = None  # PEM file of the CA that signed the server's certificate
    client_cert: str | Path | None = None  # PEM certificate chain for mTLS
    client_key: str | Path | None = None  # PEM private key for mTLS
    server_name: str | None = None  # expect this name in the server's certificate
    api_key: str | None = None  # sent as "authorization: Bearer <key>" on every call
    timeout: float | None = None  # default per-call deadline in seconds; None: no deadline
    retry: RetryPolicy = field(default_factory=RetryPolicy)

    def __post_init__(self) -> None:
        if (self.client_cert is None) != (self.client_key is None):
            raise ValueError("client_cert and client_key go together (mTLS needs both)")

    @property
    def uses_tls(self) -> bool:
        return (
            self.tls
            or self.target.startswith("grpcs://")
            or any(f is not None for f in (self.ca_cert, self.client_cert))
        )

    @property
    def address(self) -> str:
        """The target as gRPC dials it (scheme ``grpc://``/``grpcs://`` removed)."""
        for scheme in ("grpcs://", "grpc://"):
            if self.target.startswith(scheme):
                return self.target.removeprefix(scheme).rstrip("/")
        return self.target

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca_cert),
            private_key=_read(self.client_key),
            certificate_chain=_read(self.client_cert),
        )

    def channel_options(self) -> list[tuple[str, object]]:
        options: list[tuple[str, object]] = [
            # Generation responses can be long; the 4 MiB default is too tight for big outputs.
            ("grpc.max_receive_message_length", 64 * 1024 * 1024),
        ]
        if self.server_name:
            options.append(("grpc.ssl_target_name_override", self.server_name))
        return options

    def metadata(self, request_id: str | None = None) -> tuple[tuple[str, str], ...]:
        pairs = []
        api_key = _acting_for.get() or self.api_key
        if api_key:
            pairs.append((API_KEY_METADATA, bearer(api_key)))
        if request_id:
            pairs.append((REQUEST_ID_METADATA, request_id))
        pairs.extend(_trace_headers.get())
        client = _client.get()
        if client is not None:
            pairs.append((CLIENT, client))
        batch = _batch.get()
        if batch is not None:
            pairs += [(BATCH_ID, batch[0]), (BATCH_SEQUENCES, str(batch[1]))]
        return tuple(pairs)


def _read(path: str | Path | None) -> bytes | None:
    return None if path is None else Path(path).read_bytes()
