"""Bounds on the REST listener's connections: how many it holds, how long a request head takes.

uvicorn closes a keep-alive connection left idle after a response, but waits without limit for
the first request on a new connection and for the rest of a head that trickles in, and accepts
every connection the operating system hands it: clients without any key held file descriptors
until the process had none left, the gRPC port's included (seen: 20,000 idle sockets). Here:

- the listening socket (``GuardedListener``) counts the connections it accepted and has not
  closed; past ``--rest-max-connections`` it closes a new one as it accepts it, before a byte
  is read or a protocol object built, so those already held are served on;
- each connection must finish its TLS handshake, then each request head, within
  ``--request-header-timeout`` (from its accept, from its handshake, from the end of the previous
  response); a head left unfinished gets 408 and the connection closes. A request being served,
  a streamed response included, has no such bound;
- refusals are logged at once and then at most once every ``LOG_INTERVAL_S``, with their count,
  and so are the accept failures asyncio reports (out of file descriptors), which it would
  otherwise log every second of a flood.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)

LOG_INTERVAL_S = 10.0
HEAD_TIMEOUT_RESPONSE = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain\r\nconnection: close\r\n"
    b"content-length: 48\r\n\r\nthe request head did not arrive in time (408).\r\n"
)


class RateLimitedLog:
    """Logs the first of a kind of event at once, then a count at most every ``interval_s``."""

    def __init__(self, interval_s: float = LOG_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._last = float("-inf")
        self._unlogged = 0

    def due(self) -> int:
        """Count one event; how many to report now (0: stay quiet)."""
        self._unlogged += 1
        now = time.monotonic()
        if now - self._last < self.interval_s:
            return 0
        self._last, count, self._unlogged = now, self._unlogged, 0
        return count


class ConnectionBudget:
    """The connections a listener holds, their cap, and their head deadline."""

    def __init__(self, max_connections: int, header_timeout_s: float) -> None:
        self.max_connections = max_connections
        self.header_timeout_s = header_timeout_s
        self.num_open = 0
        self.num_refused = 0
        self._refusals = RateLimitedLog()
        self._waiting: dict[int, asyncio.TimerHandle] = {}  # fd -> handshake deadline

    def admit(self, connection: _Connection) -> bool:
        if self.num_open >= self.max_connections:
            self.num_refused += 1
            if count := self._refusals.due():
                logger.warning(
                    "REST gateway: closed %d new connection(s) at accept: %d open, the most "
                    "--rest-max-connections allows",
                    count,
                    self.num_open,
                )
            return False
        self.num_open += 1
        connection.budget = self
        loop = asyncio.get_running_loop()
        timer = loop.call_later(self.header_timeout_s, _cut_silent, connection)
        self._waiting[connection.fileno()] = timer
        return True

    def started(self, transport: asyncio.BaseTransport) -> None:
        """The connection's protocol is running (its TLS handshake, if any, is done)."""
        sock = transport.get_extra_info("socket")
        timer = self._waiting.pop(sock.fileno(), None) if sock is not None else None
        if timer is not None:
            timer.cancel()

    def closed(self, fd: int) -> None:
        self.num_open -= 1
        timer = self._waiting.pop(fd, None)
        if timer is not None:
            timer.cancel()


class _Connection(socket.socket):
    """An accepted socket that tells its budget when it is closed."""

    budget: ConnectionBudget | None = None

    def close(self) -> None:
        budget, self.budget = self.budget, None
        fd = self.fileno()
        super().close()
        if budget is not None:
            budget.closed(fd)


def _cut_silent(connection: _Connection) -> None:
    """End a connection whose handshake did not finish in time: shutting it down makes its
    transport see the end and close it, as for a client that went away."""
    with contextlib.suppress(OSError):
        connection.shutdown(socket.SHUT_RDWR)


class GuardedListener(socket.socket):
    """A listening socket whose accept enforces its ``budget`` (set before it serves)."""

    budget: ConnectionBudget

    def accept(self):
        fd, address = self._accept()
        connection = _Connection(self.family, self.type, self.proto, fileno=fd)
        if not self.budget.admit(connection):
            connection.close()
            # asyncio's accept loop ends quietly on this and waits for the next readiness
            raise ConnectionAbortedError("over --rest-max-connections")
        return connection, address


class GuardedH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a deadline on every request head."""

    def __init__(self, *args, budget: ConnectionBudget, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._budget = budget
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._budget.started(transport)
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # a whole head arrived
            self._cancel_head_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._arm_head_timer()

    def connection_lost(self, exc) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        timeout = self._budget.header_timeout_s
        self._head_timer = self.loop.call_later(timeout, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        pending, _ = self.conn.trailing_data
        if pending:  # part of a head: say why the connection ends
            self.transport.write(HEAD_TIMEOUT_RESPONSE)
        self.transport.close()


class AcceptErrorFilter(logging.Filter):
    """Passes asyncio's 'out of system resource' accept errors at most once an interval."""

    MESSAGE = "socket.accept() out of system resource"

    def __init__(self) -> None:
        super().__init__()
        self._log = RateLimitedLog()

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith(self.MESSAGE):
            return True
        count = self._log.due()
        if count > 1:
            record.msg = f"{record.msg}\n({count} such accept errors since the last report)"
        return count > 0


def install_accept_error_filter() -> None:
    """Once a process: rate-limit asyncio's accept-error log."""
    asyncio_logger = logging.getLogger("asyncio")
    if not any(isinstance(f, AcceptErrorFilter) for f in asyncio_logger.filters):
        asyncio_logger.addFilter(AcceptErrorFilter())
