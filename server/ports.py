"""Whether a gRPC port can be listened on, asked of the operating system before gRPC binds it.

When gRPC core cannot bind, it writes its own line to stderr (``add_port.cc ... Failed to add
port``) and hands Python only a RuntimeError without the reason. Asking first, with a socket
bound the way gRPC binds its listeners (``SO_REUSEADDR``; all addresses as one dual-stack
``[::]`` socket), lets the server stop with one line naming the flag, the address and the
operating system's reason, and gRPC never tries.
"""

from __future__ import annotations

import errno
import socket

from llmrpc.server.settings import BindError, grpc_bind_address


def check_can_listen(flag: str, host: str | None, port: int) -> None:
    """BindError naming ``flag`` if ``host:port`` is in use, or is not this machine's address.

    Port 0 (the operating system chooses) is always free. A host that resolves to several
    addresses fails if one of them is in use, or if none can be bound.
    """
    if port == 0:
        return
    addresses = _addresses(host, port)
    failures = [failure for failure in map(_try_bind, addresses) if failure]
    in_use = [f for f in failures if f.errno == errno.EADDRINUSE]
    if in_use or len(failures) == len(addresses):
        reason = (in_use or failures)[0].strerror
        address = grpc_bind_address(host, port)
        raise BindError(f"{flag} {port}: cannot listen on {address}: {reason}")


def _addresses(host: str | None, port: int) -> list[tuple]:
    """(family, socket address) for each address gRPC would listen on."""
    if not host:
        family = socket.AF_INET6 if socket.has_ipv6 else socket.AF_INET
        return [(family, ("::" if family == socket.AF_INET6 else "0.0.0.0", port))]
    try:
        found = socket.getaddrinfo(
            host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as error:
        raise BindError(
            f"--host {host}: not an address or name this machine can resolve: {error.strerror}"
        ) from None
    return list(dict.fromkeys((family, address) for family, _, _, _, address in found))


def _try_bind(family_and_address: tuple) -> OSError | None:
    family, address = family_and_address
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6 and address[0] == "::":
            probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        try:
            probe.bind(address)
        except OSError as error:
            return error
    return None
