"""When ``EngineClient.stalled`` holds (``--engine-stall-timeout``), on a clock of the test's
own: requests in flight and no message from the step loop for the bound since they started;
idle, none for the bound and ``IDLE_STALL_MIN_S`` at least; never while a slow utility (a
weight reload) runs, nor without a bound."""

from __future__ import annotations

import asyncio

import pytest

from llmrpc.engine.client import async_engine
from llmrpc.engine.client.async_engine import IDLE_STALL_MIN_S, EngineClient
from llmrpc.engine.core_types import EngineStats
from llmrpc.engine.messages import AddRequest, Call, Figures, Outputs, Result, Snapshot
from llmrpc.engine.request import RequestOutput, SamplingParams

pytestmark = pytest.mark.asyncio

BOUND_S = 1.0
SNAPSHOT = Snapshot(EngineStats(0, 0, 10, 10, 0.0, 0.0, 0.0, False), "cpu")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


class Recorder(EngineClient):
    """An engine client whose messages go nowhere but a list."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list = []
        self._snapshot = SNAPSHOT

    def _send(self, message) -> None:
        self.sent.append(message)


@pytest.fixture
def clock(monkeypatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(async_engine, "time", clock)
    return clock


@pytest.fixture
async def client(clock) -> Recorder:
    client = Recorder()
    client._loop = asyncio.get_running_loop()
    client.stall_timeout_s = BOUND_S
    return client


async def test_an_idle_engine_stalls_only_once_silent_past_the_idle_floor(clock, client):
    clock.now += IDLE_STALL_MIN_S - 0.1  # many bounds, but an idle engine reports each second
    assert not client.stalled
    clock.now += 0.2
    assert client.stalled and client.figures_age_s == pytest.approx(IDLE_STALL_MIN_S + 0.1)
    client._handle(Figures(SNAPSHOT))
    assert not client.stalled and client.figures_age_s == 0


async def test_a_request_in_flight_stalls_after_the_bound_from_its_start(clock, client):
    clock.now += 3.0  # idle for a while before the request: its first step starts now
    consuming = asyncio.ensure_future(anext(client.generate("r", [1, 2], SamplingParams())))
    await asyncio.sleep(0)
    (add,) = client.sent
    assert isinstance(add, AddRequest)
    clock.now += BOUND_S - 0.1
    assert not client.stalled
    clock.now += 0.2
    assert client.stalled and client.num_requests_in_flight == 1
    client._handle(Result(add.call_id, SNAPSHOT))
    client._handle(Outputs([RequestOutput("r", "x", [1], finished=True)], SNAPSHOT))
    assert not client.stalled
    assert (await consuming).finished


async def test_a_slow_utility_is_not_a_stall_and_no_bound_is_never_one(clock, client):
    waking = asyncio.ensure_future(client.wake_up())
    await asyncio.sleep(0)
    (call,) = client.sent
    assert isinstance(call, Call) and call.method == "wake_up"
    clock.now += 100 * IDLE_STALL_MIN_S  # reloading the weights of a big model
    assert not client.stalled
    client._handle(Result(call.call_id, SNAPSHOT))
    await waking
    clock.now += IDLE_STALL_MIN_S + 0.1
    assert client.stalled
    client.stall_timeout_s = None
    assert not client.stalled
