"""The process's open-file limit, and the connection caps derived from it.

Every connection a listener holds is a file descriptor; a process out of them can accept
nothing, on any port, and fails to open files. So each listener (the gRPC port, the REST
gateway) takes by default at most a quarter of the limit, leaving half to the other listener,
the engine's sockets and the model's files. The servers raise their soft limit to the hard
limit at start-up, as most servers do, since the usual soft default (1,024) is far below what
a busy server needs.
"""

from __future__ import annotations

import logging
import resource

logger = logging.getLogger(__name__)

CONNECTION_SHARE = 4  # each listener's default cap: the open-file limit divided by this
MIN_DEFAULT_CONNECTIONS = 64


def open_file_limit() -> int:
    """The soft limit on this process's open files (RLIMIT_NOFILE)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def raise_open_file_limit() -> int:
    """Raise the soft open-file limit to the hard one; the soft limit in force afterwards."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = max(soft, 1 << 20) if soft != resource.RLIM_INFINITY else soft
    if soft != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as error:  # a container may forbid it
            logger.debug("could not raise the open-file limit to %d: %s", hard, error)
    return open_file_limit()


def default_max_connections() -> int:
    """A listener's connection cap when its flag is not set: a quarter of the open-file limit."""
    return max(MIN_DEFAULT_CONNECTIONS, open_file_limit() // CONNECTION_SHARE)
