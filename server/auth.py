"""Who is calling, and what they may do: generation keys generate, the admin key administers.

``--api-key`` keys may call every v1 RPC but the admin-only ones; ``--admin-api-key`` keys may
call everything. Without ``--admin-api-key`` nobody is an admin and the admin-only RPCs stay
open to every accepted caller, as before that flag existed. ``Abort`` is open to all, but a
caller who is not an admin reaches only the requests its own key started. A caller is known by
the SHA-256 digest of its key, never the key itself.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import hmac
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from llmrpc.v1 import admin_pb2
from llmrpc.v1.headers import CLIENT, bearer_key

_ADMIN_SERVICE = admin_pb2.DESCRIPTOR.services_by_name["AdminService"]
# AdminService RPCs any caller may use: they only read, or (Abort) reach only the caller's own
# requests. Every other AdminService RPC, including any added later, needs an admin key.
OPEN_ADMIN_METHODS = frozenset(
    {
        "GetServerInfo",
        "GetModelInfo",
        "ListModels",
        "GetLoad",
        "IsSleeping",
        "Abort",
        "ListLoraAdapters",
    }
)


# Admin-only RPCs of the foreign services: vLLM's engine service's prefix-cache flush (the v1
# API's ResetPrefixCache) and profiler calls.
FOREIGN_ADMIN_METHODS = frozenset(
    {
        "/vllm.grpc.engine.VllmEngine/FlushCache",
        "/vllm.grpc.engine.VllmEngine/StartProfile",
        "/vllm.grpc.engine.VllmEngine/StopProfile",
    }
)


def needs_admin(method: str) -> bool:
    """Whether ``/package.Service/Method`` is an admin-only RPC."""
    if method in FOREIGN_ADMIN_METHODS:
        return True
    service, _, name = method.strip("/").partition("/")
    return service == _ADMIN_SERVICE.full_name and name not in OPEN_ADMIN_METHODS


@dataclass(frozen=True)
class Caller:
    key_digest: bytes | None  # None: a caller without a key (allowed when --api-key is unset)
    admin: bool = False


# Set for the call's own task by the API key interceptor; a server without keys has one caller.
caller_var: contextvars.ContextVar[Caller] = contextvars.ContextVar(
    "llmrpc_caller",
    default=Caller(None),  # noqa: B039 - frozen: no call can change the shared default
)


def fair_share_caller(context) -> str:
    """Who a call is for the engine's waiting queue, where callers take turns: its API key
    (by digest), else its client connection: grpc.aio's peer, or on the in-process channel
    (which has none) the REST connection that llmrpc serve's gateway says it calls for."""
    digest = caller_var.get().key_digest
    if digest is not None:
        return f"key:{digest.hex()[:16]}"
    peer = getattr(context, "peer", None)
    if peer is not None:
        return f"peer:{peer()}"
    for name, value in context.invocation_metadata() or ():
        if name == CLIENT:
            return f"rest:{value}"
    return "in-process"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def _matches(digest: bytes, digests: list[bytes]) -> bool:
    # Every key compared, each in constant time over equal-length digests: the time taken tells
    # nothing about a key's length or contents, nor which key matched.
    return any([hmac.compare_digest(digest, known) for known in digests])


class KeyRing:
    """The generation keys (``--api-key``) and admin keys (``--admin-api-key``)."""

    def __init__(self, keys: Iterable[str], admin_keys: Iterable[str] = ()) -> None:
        self._keys = [_digest(key) for key in keys]
        self._admin_keys = [_digest(key) for key in admin_keys]

    @property
    def admin_required(self) -> bool:
        return bool(self._admin_keys)

    def caller(self, authorization: str | None) -> Caller | None:
        """The caller an ``authorization`` value makes; None when a key is needed and it
        presents no known one."""
        key = bearer_key(authorization)
        digest = None if key is None else _digest(key)
        if digest is not None and _matches(digest, self._admin_keys):
            return Caller(digest, admin=True)
        if digest is not None and _matches(digest, self._keys):
            return Caller(digest)
        return None if self._keys else Caller(None)  # no --api-key: generation needs none


class RequestOwners:
    """The caller (key digest) of each live call, by request id."""

    def __init__(self) -> None:
        self._owners: dict[str, list[bytes | None]] = {}

    @contextlib.contextmanager
    def record(self, request_id: str, owner: bytes | None) -> Iterator[None]:
        """``owner`` started ``request_id``, for the block."""
        owners = self._owners.setdefault(request_id, [])
        owners.append(owner)
        try:
            yield
        finally:
            owners.remove(owner)
            if not owners:
                del self._owners[request_id]

    def owned_by(self, request_ids: Iterable[str], owner: bytes | None) -> list[str]:
        """Those of ``request_ids`` that ``owner`` alone started. An id in use by a second
        caller too (a duplicate the engine is about to refuse) is no one's to abort."""
        return [rid for rid in request_ids if set(self._owners.get(rid, ())) == {owner}]
