"""The data-parallel routing policy (``--data-parallel-size``): least load, turns among equals,
prefix preference within its slack; the CPU split; and a ``DataParallelClient`` over stand-in
engines: where requests, aborts and admin calls go, and what its figures add up to."""

from __future__ import annotations

import asyncio
import inspect

import pytest

from llmrpc.engine.client.async_engine import EngineClient
from llmrpc.engine.client.data_parallel import DataParallelClient, cpu_shares, sum_stats
from llmrpc.engine.client.dp_balance import MAX_PREFIX_BLOCKS, LoadBalancer, prefix_hashes
from llmrpc.engine.core_types import EngineStats
from llmrpc.engine.request import RequestOutput, SamplingParams

BLOCK = 4
SHARED = list(range(100, 100 + 3 * BLOCK))  # three full blocks


def test_least_loaded_engine_wins_and_ties_take_turns():
    balancer = LoadBalancer(3, BLOCK)
    assert [balancer.choose([1]) for _ in range(4)] == [0, 1, 2, 0]  # all idle: in turn
    balancer.started(0, 2)
    balancer.started(2)
    assert balancer.choose([1]) == 1  # the least loaded, whoever's turn it is
    balancer.started(1, 3)
    assert balancer.choose([1]) == 2
    balancer.finished(0, 2)
    assert balancer.choose([1]) == 0


def test_a_known_prefix_goes_back_to_its_engine_while_that_is_within_the_slack():
    balancer = LoadBalancer(2, BLOCK, prefix_slack=2)
    assert balancer.choose(SHARED + [1]) == 0
    balancer.started(0)
    balancer.started(0)
    # Engine 1 is idle, engine 0 holds 2 (within the slack): the prefix wins.
    assert balancer.choose(SHARED + [2]) == 0
    balancer.started(0)  # 3 more than engine 1: beyond the slack, the least-loaded engine
    assert balancer.choose(SHARED + [3]) == 1


def test_the_longest_remembered_prefix_wins():
    balancer = LoadBalancer(2, BLOCK)
    assert balancer.choose(SHARED[:BLOCK]) == 0  # one block remembered on engine 0
    assert balancer.choose(SHARED) == 0  # by its first block; now three blocks there too
    balancer = LoadBalancer(2, BLOCK)
    balancer.choose([7] * BLOCK)  # engine 0
    assert balancer.choose(SHARED[:BLOCK]) == 1  # the first block, on engine 1
    assert balancer.choose(SHARED[: 2 * BLOCK] + [9] * BLOCK) == 1
    assert balancer.choose([8] * BLOCK) == 0  # nothing known: in turn


def test_an_unavailable_engine_takes_nothing_while_another_can():
    balancer = LoadBalancer(3, BLOCK)
    assert balancer.choose(SHARED) == 0  # its prefix remembered on engine 0
    balancer.started(1, 5)
    # engine 0 stalled: neither its prefix nor its (least) load sends the request there
    assert balancer.choose(SHARED, unavailable=[0]) == 2
    assert [balancer.choose([1], unavailable=[0, 2]) for _ in range(2)] == [1, 1]
    assert balancer.choose(SHARED, unavailable=[0]) == 2  # the prefix now remembered there
    # every engine stalled: routed as if none were (health says NOT_SERVING meanwhile)
    assert balancer.choose([1], unavailable=[0, 1, 2]) == 0


def test_prompts_shorter_than_a_block_and_prefix_caching_off_are_balanced_by_load_alone():
    balancer = LoadBalancer(2, BLOCK)
    assert [balancer.choose(SHARED[: BLOCK - 1]) for _ in range(2)] == [0, 1]
    off = LoadBalancer(2, BLOCK, prefix_aware=False)
    assert [off.choose(SHARED) for _ in range(2)] == [0, 1]


def test_prefix_hashes_are_chained_bounded_and_forgotten_oldest_first():
    hashes = prefix_hashes(SHARED, BLOCK)
    assert len(hashes) == 3 and len(set(hashes)) == 3
    other = prefix_hashes([0] * BLOCK + SHARED[BLOCK:], BLOCK)
    assert other[1:] != hashes[1:]  # the same later blocks after another first one differ
    assert len(prefix_hashes(list(range(BLOCK * 20)), BLOCK)) == MAX_PREFIX_BLOCKS
    balancer = LoadBalancer(2, BLOCK, max_prefixes=2)
    balancer.choose(SHARED)  # 3 prefixes, 2 kept: the longest two
    assert balancer.choose(SHARED[:BLOCK]) == 1  # its one-block prefix was forgotten


def test_cpu_shares_leave_a_core_to_the_frontend_when_each_engine_can_still_have_one():
    assert cpu_shares(2, 2) == [1, 1]
    assert cpu_shares(2, 3) == [1, 1]
    assert cpu_shares(2, 4) == [2, 1]
    assert cpu_shares(4, 16) == [4, 4, 4, 3]
    assert cpu_shares(3, 2) == [1, 1, 1]


def test_a_bad_size_names_the_flag():
    with pytest.raises(ValueError, match="--data-parallel-size"):
        LoadBalancer(0, BLOCK)


def test_the_client_offers_every_public_name_of_an_engine_client():
    """A method added to ``EngineClient`` must be routed by the data-parallel client too."""
    wanted = {name for name, _ in inspect.getmembers(EngineClient) if not name.startswith("_")}
    missing = {name for name in wanted if not hasattr(DataParallelClient, name)}
    assert missing <= {"dead_error", "on_dead"}, missing  # instance attributes of both


# --- the client over stand-in engines -----------------------------------------------------------


def stats(running: int, blocks: int = 10, hit_rate: float = 0.0) -> EngineStats:
    return EngineStats(running, 0, blocks - running, blocks, hit_rate, 5.0, 1.0, False)


class StandInEngine:
    """Holds each request until released; records what reaches it."""

    def __init__(self) -> None:
        self.on_dead: list = []
        self.requests: list[str] = []
        self.aborts: list[list[str]] = []
        self.resets = 0
        self.release = asyncio.Event()
        self.stats = stats(0)
        self.stalled = False

    async def generate(self, request_id, prompt_token_ids, params):
        self.requests.append(request_id)
        await self.release.wait()
        yield RequestOutput(request_id, "x", [1], finished=True)

    async def abort(self, request_ids):
        self.aborts.append(list(request_ids))
        return list(request_ids)

    async def reset_prefix_cache(self):
        self.resets += 1
        return self.resets == 1


async def drain(client, request_id: str) -> None:
    async for _ in client.generate(request_id, [1, 2], SamplingParams()):
        pass


async def test_requests_aborts_and_admin_calls_reach_the_right_stand_in_engines():
    engines = [StandInEngine(), StandInEngine()]
    client = DataParallelClient(engines, LoadBalancer(2, BLOCK))
    tasks = [asyncio.create_task(drain(client, f"r{i}")) for i in range(4)]
    await asyncio.sleep(0.01)
    assert [e.requests for e in engines] == [["r0", "r2"], ["r1", "r3"]]
    assert client.balancer.loads == [2, 2] and client.engine_of("r3") == 1
    assert sorted(await client.abort(["r3", "r0", "gone"])) == ["r0", "r3"]
    assert [e.aborts for e in engines] == [[["r0"]], [["r3"]]]
    for engine in engines:
        engine.release.set()
    await asyncio.gather(*tasks)
    assert client.balancer.loads == [0, 0] and client.engine_of("r3") is None
    assert await client.reset_prefix_cache() is True
    assert await client.reset_prefix_cache() is False  # both asked again; both say no


async def test_one_engine_dying_kills_the_client_and_tells_its_listeners():
    engines = [StandInEngine(), StandInEngine()]
    client = DataParallelClient(engines, LoadBalancer(2, BLOCK))
    heard = []
    client.on_dead.append(heard.append)
    engines[1].on_dead[0](RuntimeError("the engine process (pid 7) was killed by SIGKILL"))
    assert "data-parallel engine 1: the engine process (pid 7)" in str(client.dead_error)
    assert heard == [client.dead_error]
    with pytest.raises(RuntimeError, match="data-parallel engine 1"):
        await drain(client, "late")


async def test_a_stalled_engine_gets_no_new_request_and_the_client_stalls_with_all():
    engines = [StandInEngine(), StandInEngine()]
    client = DataParallelClient(engines, LoadBalancer(2, BLOCK))
    engines[0].stalled = True
    tasks = [asyncio.create_task(drain(client, f"r{i}")) for i in range(3)]
    await asyncio.sleep(0.01)
    assert [e.requests for e in engines] == [[], ["r0", "r1", "r2"]]
    assert client.engine_stalls == [True, False] and not client.stalled
    engines[1].stalled = True
    assert client.stalled
    for engine in engines:
        engine.release.set()
    await asyncio.gather(*tasks)


def test_figures_add_up_and_the_hit_rate_is_averaged():
    total = sum_stats([stats(2, 10, 0.5), stats(3, 20, 0.25)])
    assert (total.num_running, total.num_total_blocks, total.num_free_blocks) == (5, 30, 25)
    assert total.generation_throughput == 10.0 and total.prefix_cache_hit_rate == 0.375
    assert total.is_sleeping is False
