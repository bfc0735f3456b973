"""What the llmrpc v1 API reads from request headers (gRPC metadata and HTTP headers alike): the
bearer API key and the request id.

Hand-written, not generated. It lives beside the protos because it is part of the same contract
and because this package is the one place both sides may import: the server (server -> protos)
and the REST gateway (gateway -> clients -> protos) parse these headers with these functions, so
gRPC and REST cannot drift apart, and the clients write them with them.
"""

from __future__ import annotations

AUTHORIZATION = "authorization"
REQUEST_ID = "x-request-id"
# A REST request that the gateway sends as several calls (one per prompt) marks each with its
# own id and the sequences (prompts x n) of the whole request, so the server's waiting-queue
# bound (--max-waiting-requests) counts the request whole rather than call by call.
BATCH_ID = "x-llmrpc-batch-id"
BATCH_SEQUENCES = "x-llmrpc-batch-sequences"
# The REST client (its connection, host:port) a call of llmrpc serve's own gateway is made for:
# callers take turns in the engine's queue, and a REST caller without a key is its connection,
# as a gRPC one is. Read only from the server's in-process channel.
CLIENT = "x-llmrpc-client"

# Request ids: 1 to 256 visible ASCII characters (0x21-0x7E) on gRPC. They go into response
# metadata (which allows only printable ASCII) and into every log line about the request, so
# no spaces, control characters or non-ASCII, and a bound that keeps a log line a line.
MAX_REQUEST_ID_LENGTH = 256
_SCHEME = "bearer"
_OWS = " \t"  # HTTP's optional whitespace, allowed around a whole field value


def bearer(key: str) -> str:
    """The ``authorization`` value that presents ``key``."""
    return f"Bearer {key}"


def bearer_key(value: str | bytes | None) -> str | None:
    """The key in an ``authorization`` value, or None if it presents none.

    RFC 7235 credentials of RFC 6750's scheme: ``Bearer``, in any case, then one or more spaces,
    then the key (everything after the spaces; a key cannot be empty). Spaces and tabs around the
    whole value are ignored, as HTTP ignores them around any field value. Nothing else is
    accepted: no other scheme, no tab between the scheme and the key, no key alone.
    """
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")  # an HTTP field value; gRPC's is ASCII
    scheme, space, key = (value or "").strip(_OWS).partition(" ")
    key = key.lstrip(" ")
    if scheme.lower() != _SCHEME or not space or not key:
        return None
    return key


def request_id_problem(value: str, max_length: int = MAX_REQUEST_ID_LENGTH) -> str | None:
    """Why ``value`` cannot be a request id, or None if it can."""
    if not value:
        return "must not be empty"
    if len(value) > max_length:
        return f"must be at most {max_length} characters, got {len(value)}"
    if not all("!" <= char <= "~" for char in value):
        return "must be visible ASCII characters (0x21-0x7E): no spaces, controls or non-ASCII"
    return None
