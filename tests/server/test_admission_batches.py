"""A request that reaches the server as several calls (the REST gateway's multi-prompt
completions: one call per prompt, each marked with the whole request's batch id and sequences)
is admitted to the waiting queue whole: its first call takes places for all of it or fails, so
it cannot slip in part by part; a claim smaller than what is sent lets nothing extra past."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest

from llmrpc.server.errors import InvalidArgument, ResourceExhausted
from llmrpc.server.limits import AdmissionControl, batch_of
from llmrpc.v1.headers import BATCH_ID, BATCH_SEQUENCES

MAX_WAITING = 8


def engine_running(num_running: int = 0) -> SimpleNamespace:
    return SimpleNamespace(stats=SimpleNamespace(num_running=num_running))


def test_the_first_part_takes_places_for_the_whole_request_or_none():
    admission, engine = AdmissionControl(MAX_WAITING), engine_running()
    with admission.admit(engine, num_samples=3):  # someone else's 3 wait
        with pytest.raises(ResourceExhausted), admission.admit(engine, 1, (None, "r", 6)):
            pass  # 1 sample would fit; the request's 6 do not
        assert admission.num_in_flight == 3
        with contextlib.ExitStack() as parts:
            for _ in range(5):
                parts.enter_context(admission.admit(engine, 1, (None, "r", 5)))
            assert admission.num_in_flight == 8
            with pytest.raises(ResourceExhausted), admission.admit(engine, 1):
                pass  # the request's parts took the rest
    assert admission.num_in_flight == 0


def test_places_for_parts_still_to_come_are_held_until_the_last_part_ends():
    admission, engine = AdmissionControl(MAX_WAITING), engine_running()
    with admission.admit(engine, 2, (None, "r", 6)):
        assert admission.num_in_flight == 6  # 2 here, 4 for the parts to come
        with pytest.raises(ResourceExhausted), admission.admit(engine, 3):
            pass
        with admission.admit(engine, 2, (None, "r", 6)):
            pass
        assert admission.num_in_flight == 4  # that part's 2 are done
    assert admission.num_in_flight == 0


def test_a_claim_smaller_than_the_parts_lets_no_more_in_than_the_bound():
    admission, engine = AdmissionControl(MAX_WAITING), engine_running()
    with contextlib.ExitStack() as parts:
        for _ in range(MAX_WAITING):
            parts.enter_context(admission.admit(engine, 1, (None, "liar", 1)))
        with pytest.raises(ResourceExhausted), admission.admit(engine, 1, (None, "liar", 1)):
            pass
    assert admission.num_in_flight == 0


def test_batches_of_different_callers_are_apart():
    admission, engine = AdmissionControl(MAX_WAITING), engine_running()
    with admission.admit(engine, 1, (b"a", "r", 4)), admission.admit(engine, 1, (b"b", "r", 4)):
        assert admission.num_in_flight == 8


def test_a_request_that_could_never_fit_is_the_clients_error():
    admission = AdmissionControl(MAX_WAITING)
    with (
        pytest.raises(InvalidArgument) as failure,
        admission.admit(engine_running(), 1, (None, "r", MAX_WAITING + 1)),
    ):
        pass
    assert failure.value.field == BATCH_SEQUENCES


def test_batch_metadata():
    metadata = ((BATCH_ID, "req-1"), (BATCH_SEQUENCES, "12"), ("x-request-id", "req-1-0"))
    assert batch_of(metadata, b"k") == (b"k", "req-1", 12)
    assert batch_of((("x-request-id", "r"),), None) is None
    for bad in (((BATCH_ID, "r"),), ((BATCH_ID, "r"), (BATCH_SEQUENCES, "0")),
                ((BATCH_ID, "r"), (BATCH_SEQUENCES, "-3")), ((BATCH_SEQUENCES, "3"),)):  # fmt: skip
        with pytest.raises(InvalidArgument):
            batch_of(bad, None)
