"""Transport limits as gRPC channel arguments, and the bound on the waiting queue.

gRPC ignores channel-argument names it does not know, silently, so these names are the real
ones from gRPC core (grpc_types.h); tests/server/test_limits.py shows each takes effect.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from llmrpc.common.fanout import DEFAULT_MAX_PROMPTS_PER_REQUEST, DEFAULT_MAX_SEQUENCES_PER_REQUEST
from llmrpc.common.fd_limit import default_max_connections
from llmrpc.server.errors import InvalidArgument, ResourceExhausted
from llmrpc.server.settings import LimitsConfig
from llmrpc.v1.headers import BATCH_ID, BATCH_SEQUENCES, request_id_problem

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


@dataclass
class _Batch:
    """The places one multi-call request holds: its whole claim until its parts are done."""

    num_places: int  # held for the whole request: its parts running, waiting and still to come
    num_used: int = 0  # samples of its parts in flight
    num_parts: int = 0


class AdmissionControl:
    """Bounds one request's fan-out and the samples waiting for a place in the engine's batch.

    A request for n samples takes n places: the engine runs each sample as a sequence of its
    own. Samples in flight are counted here (the event loop is single-threaded, so the count is
    exact); those the engine is not running are waiting, including ones on their way in and,
    until their request ends, samples that have already finished (a conservative count).

    A REST request of several prompts reaches the server as one call per prompt, each marked
    with the whole request's batch id and sequences (``llmrpc.v1.headers.BATCH_ID``). Its first
    call takes places for all of them, or is refused for all of them; its later calls use those
    places, and a call beyond the claim is checked as a request of its own (a claim cannot let
    more in than it names). The places go back as the calls end, the rest with the last one.
    """

    def __init__(
        self,
        max_waiting: int | None,
        max_prompts: int = DEFAULT_MAX_PROMPTS_PER_REQUEST,
        max_sequences: int = DEFAULT_MAX_SEQUENCES_PER_REQUEST,
    ) -> None:
        self.max_waiting = max_waiting
        self.max_prompts = max_prompts
        self.max_sequences = max_sequences
        self.num_in_flight = 0
        self._batches: dict[tuple[bytes | None, str], _Batch] = {}

    def check_samples(self, num_samples: int, field: str = "sampling.n") -> None:
        """InvalidArgument naming ``field`` past --max-sequences-per-request."""
        if num_samples > self.max_sequences:
            raise InvalidArgument(
                field,
                f"at most {self.max_sequences} sequences per request on this server "
                f"(--max-sequences-per-request), got {num_samples}",
            )

    def check_prompts(self, num_prompts: int, field: str) -> None:
        """InvalidArgument naming ``field`` past either bound (each prompt is a sequence)."""
        if num_prompts > self.max_prompts:
            raise InvalidArgument(
                field,
                f"at most {self.max_prompts} per request on this server "
                f"(--max-prompts-per-request), got {num_prompts}",
            )
        self.check_samples(num_prompts, field)

    @contextlib.contextmanager
    def admit(self, engine, num_samples: int = 1, batch=None) -> Iterator[None]:
        """Hold places for one call's samples; ResourceExhausted if the queue is full.
        ``batch``: (caller, batch id, sequences of the whole request) for a call that is one
        part of a request (``batch_of``)."""
        if batch is not None:
            with self._admit_part(engine, num_samples, batch):
                yield
            return
        if self.max_waiting is not None:
            self._check_room(engine, num_samples)
        self.num_in_flight += num_samples
        try:
            yield
        finally:
            self.num_in_flight -= num_samples

    @contextlib.contextmanager
    def _admit_part(self, engine, num_samples: int, batch) -> Iterator[None]:
        caller, batch_id, num_sequences = batch
        key = (caller, batch_id)
        entry = self._batches.get(key)
        if entry is None:
            places = max(num_sequences, num_samples)
            if self.max_waiting is not None:
                self._check_room(engine, places, BATCH_SEQUENCES)
            entry = self._batches[key] = _Batch(places)
            self.num_in_flight += places
        elif entry.num_used + num_samples > entry.num_places:  # beyond its claim
            extra = entry.num_used + num_samples - entry.num_places
            if self.max_waiting is not None:
                self._check_room(engine, extra)
            entry.num_places += extra
            self.num_in_flight += extra
        entry.num_used += num_samples
        entry.num_parts += 1
        try:
            yield
        finally:
            entry.num_used -= num_samples
            entry.num_parts -= 1
            entry.num_places -= num_samples  # this part's samples are done
            self.num_in_flight -= num_samples
            if not entry.num_parts:  # no part left: what it held for parts to come goes back
                self.num_in_flight -= entry.num_places
                del self._batches[key]

    def _check_room(self, engine, num_samples: int, field: str = "sampling.n") -> None:
        if 0 < self.max_waiting < num_samples:  # retrying would never help: the client's error
            raise InvalidArgument(
                field,
                f"at most {self.max_waiting} samples on this server (--max-waiting-requests)"
                + (f", got {num_samples} in one request" if field == BATCH_SEQUENCES else ""),
            )
        num_waiting = self.num_in_flight - engine.stats.num_running
        if num_waiting + num_samples > self.max_waiting:
            raise ResourceExhausted(
                f"the server's waiting queue is full ({self.max_waiting} samples, "
                "--max-waiting-requests); retry later",
                retry_after_s=RETRY_DELAY_S,
            )


def batch_of(metadata, caller: bytes | None) -> tuple[bytes | None, str, int] | None:
    """(caller, batch id, sequences) of a call that is one part of a multi-call request, from
    its metadata; None for a call of its own. InvalidArgument naming the metadata if bad."""
    batch_id = sequences = None
    for name, value in metadata or ():
        if name == BATCH_ID:
            batch_id = value
        elif name == BATCH_SEQUENCES:
            sequences = value
    if batch_id is None and sequences is None:
        return None
    if not batch_id or request_id_problem(batch_id):
        raise InvalidArgument(BATCH_ID, "1 to 256 visible ASCII characters, with batch sequences")
    if sequences is None or not sequences.isdigit() or int(sequences) < 1 or len(sequences) > 9:
        raise InvalidArgument(BATCH_SEQUENCES, "a whole number from 1, with a batch id")
    return caller, batch_id, int(sequences)
