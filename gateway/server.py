"""Serving the gateway's app with uvicorn: the listening socket, TLS, HTTP/1.1 limits, logging.

The listener's connections are bounded in number and in the time a request head may take
(``connections``).

The socket is bound here, before uvicorn starts (``bind``, or ``start`` if not bound yet), so a
port in use is one clear error and the port the OS chose (``--port 0``) is known at once. The
program running the gateway handles SIGTERM and SIGINT (uvicorn's own handlers are not
installed). With ``--enable-ssl-refresh`` replaced certificate files are loaded into the live
TLS context, so new connections get them without a restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import os
import socket
import ssl

import uvicorn

from llmrpc.common.fd_limit import default_max_connections
from llmrpc.common.tls_files import check_tls_files
from llmrpc.gateway.connections import (
    ConnectionBudget,
    GuardedH11Protocol,
    GuardedListener,
    install_accept_error_filter,
)
from llmrpc.gateway.settings import HttpSettings

logger = logging.getLogger(__name__)

SSL_REFRESH_INTERVAL_S = 1.0
CERT_REQS = (ssl.CERT_NONE, ssl.CERT_OPTIONAL, ssl.CERT_REQUIRED)


class BindError(RuntimeError):
    """The REST listener could not be bound."""


class _EmbeddedServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):  # the program running the gateway handles SIGTERM and SIGINT
        yield


def uvicorn_config(app, http: HttpSettings, budget: ConnectionBudget) -> uvicorn.Config:
    """uvicorn's configuration, its TLS context loaded; ValueError naming the flag for a TLS
    file that is wrong."""
    if http.tls:
        check_tls_files(http.ssl_keyfile, http.ssl_certfile, http.ssl_ca_certs)
    config = uvicorn.Config(
        app,
        root_path=http.root_path or "",
        # h11, the parser --h11-max-incomplete-event-size and --h11-max-header-count limit,
        # with a deadline on each request head
        http=functools.partial(GuardedH11Protocol, budget=budget),
        timeout_keep_alive=http.keep_alive_timeout_s,
        h11_max_incomplete_event_size=http.h11_max_incomplete_event_size,
        log_level=http.uvicorn_log_level,
        access_log=not http.disable_uvicorn_access_log,
        ssl_keyfile=http.ssl_keyfile,
        ssl_certfile=http.ssl_certfile,
        ssl_ca_certs=http.ssl_ca_certs,
        ssl_cert_reqs=CERT_REQS[http.ssl_cert_reqs],
        lifespan="on",
        timeout_graceful_shutdown=5,
    )
    config.load()
    return config


def bind_socket(http: HttpSettings, budget: ConnectionBudget) -> GuardedListener:
    """The listening socket, accepting within ``budget``; BindError naming the flag."""
    try:
        sock = _bind_unix(http.uds) if http.uds else _bind_tcp(http.host, http.port)
    except OSError as error:
        reason = error.strerror or str(error)
        if http.uds:
            raise BindError(f"--uds {http.uds}: cannot listen there: {reason}") from None
        address = _shown_address(http.host, http.port)
        raise BindError(f"--port {http.port}: cannot listen on {address}: {reason}") from None
    sock.budget = budget
    return sock


def _shown_address(host: str | None, port: int) -> str:
    host = host or _all_addresses()
    return f"[{host.strip('[]')}]:{port}" if ":" in host else f"{host}:{port}"


def _all_addresses() -> str:
    return "::" if socket.has_ipv6 else "0.0.0.0"


def _bind_unix(path: str) -> GuardedListener:
    if os.path.exists(path) and not os.path.isdir(path):
        if _listened_on(path):
            raise OSError(errno.EADDRINUSE, "in use by a running process")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # a socket file left by an earlier run
    sock = GuardedListener(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    return sock


def _listened_on(path: str) -> bool:
    """Whether a process accepts connections on the Unix socket ``path``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except OSError:  # refused (nobody listens), not a socket, or gone
            return False
        return True


def _bind_tcp(host: str | None, port: int) -> GuardedListener:
    if not host:  # all addresses: IPv6 and IPv4 on one socket where the machine has IPv6
        host = _all_addresses()
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP, not 0: asyncio turns Nagle's algorithm off (TCP_NODELAY) only on
    # connections whose socket says TCP, and with it on a chunk written after a small unacknowledged
    # one (an SSE event after the headers) waits for the client's delayed ACK, about 40 ms.
    sock = GuardedListener(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    try:
        sock.bind((host.strip("[]"), port))
    except OSError:
        sock.close()
        raise
    return sock


class GatewayServer:
    """uvicorn serving the app on a socket bound here; ``start`` returns once it accepts.

    Built, it has read its TLS files (ValueError naming the flag) but holds no port yet.
    """

    def __init__(self, app, http: HttpSettings) -> None:
        self.http = http
        max_connections = http.max_connections or default_max_connections()
        self.connections = ConnectionBudget(max_connections, http.header_timeout_s)
        self.config = uvicorn_config(app, http, self.connections)
        self.server = _EmbeddedServer(self.config)
        self.socket: GuardedListener | None = None
        self._task: asyncio.Task | None = None
        self._refresher: asyncio.Task | None = None

    def bind(self) -> None:
        """Take the listening socket now; BindError if it cannot be bound."""
        if self.socket is None:
            self.socket = bind_socket(self.http, self.connections)
            install_accept_error_filter()

    @property
    def port(self) -> int | None:
        if self.http.uds or self.socket is None:
            return None
        return self.socket.getsockname()[1]

    async def start(self) -> None:
        self.bind()
        self._task = asyncio.create_task(self.server.serve(sockets=[self.socket]))
        while not self.server.started:
            if self._task.done():
                await self._task  # raises what stopped it
                raise RuntimeError("the REST gateway stopped while starting")
            await asyncio.sleep(0.01)
        if self.http.enable_ssl_refresh:
            self._refresher = asyncio.create_task(self._refresh_certificates())
        scheme = "https" if self.http.tls else "http"
        where = f"unix:{self.http.uds}" if self.http.uds else f"port {self.port}"
        logger.info("OpenAI-compatible REST gateway (%s) listening on %s", scheme, where)

    @property
    def stopped(self) -> asyncio.Task:
        """Done when uvicorn stops by itself."""
        assert self._task is not None
        return self._task

    async def stop(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
        self.server.should_exit = True
        if self._task is not None:
            await self._task
        if self.socket is None:
            return
        self.socket.close()
        if self.http.uds:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.http.uds)

    def _file_times(self) -> tuple:
        files = (self.http.ssl_certfile, self.http.ssl_keyfile, self.http.ssl_ca_certs)
        return tuple(os.stat(f).st_mtime_ns if f and os.path.exists(f) else None for f in files)

    async def _refresh_certificates(self) -> None:
        seen = self._file_times()
        while True:
            await asyncio.sleep(SSL_REFRESH_INTERVAL_S)
            now = self._file_times()
            if now != seen:
                seen = now
                self._reload_certificates()

    def _reload_certificates(self) -> None:
        context, http = self.config.ssl, self.http
        try:
            context.load_cert_chain(http.ssl_certfile, http.ssl_keyfile)
            if http.ssl_ca_certs:
                context.load_verify_locations(http.ssl_ca_certs)
        except (OSError, ssl.SSLError) as error:  # half-written files: the next change retries
            logger.warning("could not reload the REST gateway's TLS files: %s", error)
            return
        logger.info("REST gateway: reloaded its TLS certificate files")
