"""When one request (one sample) went through the engine core, for tracing.

The core records a ``RequestTimings`` only for a request whose ``SamplingParams.collect_timings``
is set (the server sets it when the call is traced, ``server/tracing.py``); for the others the
per-step work here is one attribute check per scheduled request. Times are wall-clock seconds
(``time.time()``), so spans built from them in the server's process line up with its own: the
engine core runs on the same machine, as a thread or a process.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass
class RequestTimings:
    """Wall-clock times (seconds since the epoch; 0.0: not reached) and summed durations."""

    arrival: float  # the core queued the request
    first_scheduled: float = 0.0  # the first step that computed some of it began its forward pass
    first_token: float = 0.0  # the step that sampled its first output token ended
    last_token: float = 0.0  # the step that sampled its last output token ended
    finished: float = 0.0  # its last output was made
    num_steps: int = 0  # engine steps that computed some of its tokens
    # Summed over those steps, each step's whole duration (the batch shares it):
    model_forward_s: float = 0.0  # the model's forward pass (the runner's execute call)
    model_execute_s: float = 0.0  # forward pass and sampling, until the tokens are on the host
    detokenize_s: float = 0.0  # its own incremental detokenization, token by token


def start_timings(requests) -> None:
    """Give each of a new request's samples a record, arrived now."""
    now = time.time()
    for request in requests:
        request.timings = RequestTimings(arrival=now)


def record_step(scheduled, updated, started: float, forward_s: float, execute_s: float) -> None:
    """Charge one step to the timed requests it computed (``scheduled``: (request, tokens)
    pairs) and stamp the token times of those that got a token (``updated``). ``started``: when
    the step's forward pass began (``time.time()``)."""
    now = 0.0
    for request, _ in scheduled:
        timings = request.timings
        if timings is None:
            continue
        if not timings.first_scheduled:
            timings.first_scheduled = started
        timings.num_steps += 1
        timings.model_forward_s += forward_s
        timings.model_execute_s += execute_s
        now = now or time.time()
    if not now:  # no timed request in this step
        return
    for request in updated:
        timings = request.timings
        if timings is not None:
            timings.first_token = timings.first_token or now
            timings.last_token = now


def finish_timings(request) -> RequestTimings | None:
    """The record of a request whose last output is being made, stamped finished."""
    timings = request.timings
    if timings is not None:
        timings.finished = time.time()
    return timings


def detokenize_timed(detokenizer, request) -> str | None:
    """``detokenizer.add_token`` of the request's newest token, its time added to the record."""
    started = time.perf_counter()
    try:
        return detokenizer.add_token(request.output_token_ids[-1])
    finally:
        request.timings.detokenize_s += time.perf_counter() - started
