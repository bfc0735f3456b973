"""``DataParallelClient``: ``--data-parallel-size N`` on one machine, N engine processes behind
one frontend, presented as one engine.

Each engine is an ``EngineProcessClient`` (its own process, model copy, KV cache and step
loop). A new request goes to the engine ``dp_balance.LoadBalancer`` chooses (least load,
prefix preference); its outputs, aborts and cancellation stay with that engine. Admin calls
(prefix cache reset, sleep and wake, LoRA adapters) go to every engine; figures are the sum of
the engines' (``engine_stats`` keeps each one's); model facts are engine 0's. The engines take
token ids: the server loads one tokenizer set for all of them (``server/tokenization.py``).
The server serves once every engine has loaded and served a warm-up request; if any engine
process dies, the whole client is dead, as one engine's death is (the server stops). An engine
that has stalled (``EngineClient.stalled``: stopped, or a step that does not return) takes no
new request while another has not; the client is stalled, and health NOT_SERVING, only when
every engine is: the others serve meanwhile, and its requests wait for it.

Cores: on the CPU the engines split the machine's cores between them (``engine_environments``):
each engine process gets ``OMP_NUM_THREADS`` set to its share, unless the environment
already sets it. On CUDA each engine sees one device of its own through
``CUDA_VISIBLE_DEVICES``.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import functools
import logging
import operator
import os
from collections.abc import AsyncIterator, Iterable

from llmrpc.engine.client.dp_balance import LoadBalancer
from llmrpc.engine.client.kv_events import KVEventLog
from llmrpc.engine.client.process import EngineProcessClient
from llmrpc.engine.config import EngineConfig
from llmrpc.engine.core_types import EngineStats, ModelInfo
from llmrpc.engine.messages import EngineDeadError
from llmrpc.engine.request import InvalidRequestError, RequestOutput, SamplingParams

logger = logging.getLogger(__name__)

# The engine a caller's request must run on (its rank), for requests started in this context;
# None: the balancer chooses. vLLM's engine service sets it from GenerateRequest.data_parallel_rank.
pinned_rank: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "llmrpc_pinned_rank", default=None
)


def cpu_shares(num_engines: int, cores: int) -> list[int]:
    """Torch threads per engine: the cores less one left to the frontend, split as evenly as
    they go (the first engines get the remainder); all the cores where fewer than one each
    would be left; at least one thread each."""
    usable = cores - 1 if cores - 1 >= num_engines else cores
    base, extra = divmod(usable, num_engines)
    return [max(1, base + (index < extra)) for index in range(num_engines)]


def engine_environments(
    num_engines: int, config: EngineConfig, environ=os.environ, cores: int | None = None
) -> list[dict[str, str]]:
    """The environment of each engine process."""
    if cores is None:
        cores = len(os.sched_getaffinity(0))
    shares = cpu_shares(num_engines, cores)
    visible = [d for d in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    environments = []
    for index in range(num_engines):
        env = dict(environ)
        if not environ.get("OMP_NUM_THREADS", "").strip():
            env["OMP_NUM_THREADS"] = str(shares[index])
        if config.model.device != "cpu":  # one device each (absent ones: checked once loaded)
            env["CUDA_VISIBLE_DEVICES"] = visible[index] if index < len(visible) else str(index)
        environments.append(env)
    return environments


class DataParallelClient:
    """N engine processes behind the surface of one ``EngineClient``."""

    def __init__(self, engines: list[EngineProcessClient], balancer: LoadBalancer) -> None:
        self.engines = engines
        self.balancer = balancer
        self._owners: dict[str, int] = {}  # live request id -> its engine
        self.dead_error: BaseException | None = None
        self.on_dead: list = []  # callbacks run on the event loop when an engine dies
        for index, engine in enumerate(engines):
            engine.on_dead.append(lambda error, index=index: self._engine_died(index, error))
        # --kv-events-config: one log for all the engines (share_kv_event_log)
        self.kv_event_log: KVEventLog | None = None

    @classmethod
    async def create(cls, config: EngineConfig, num_engines: int) -> DataParallelClient:
        """Start ``num_engines`` engine processes together; once all have loaded, the client.
        Raises what loading raised in any (the others are stopped)."""
        environments = engine_environments(num_engines, config)
        for index, env in enumerate(environments):
            logger.info(
                "data parallel: engine %d of %d with %s torch thread(s)%s",
                index,
                num_engines,
                env.get("OMP_NUM_THREADS", "the default rule's"),
                f", CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']}"
                if "CUDA_VISIBLE_DEVICES" in env
                else "",
            )
        starts = [EngineProcessClient.create(config, env=env) for env in environments]
        results = await asyncio.gather(*starts, return_exceptions=True)
        engines = [r for r in results if isinstance(r, EngineProcessClient)]
        failures = [r for r in results if isinstance(r, BaseException)]
        try:
            if failures:
                raise failures[0]
            _check_devices(engines)
        except BaseException:
            await asyncio.gather(*(engine.shutdown() for engine in engines))
            raise
        cache = config.cache
        balancer = LoadBalancer(num_engines, cache.block_size, cache.enable_prefix_caching)
        client = cls(engines, balancer)
        client.share_kv_event_log(KVEventLog.for_config(config))
        return client

    def share_kv_event_log(self, log: KVEventLog | None) -> None:
        """Every engine's prefix-cache events into ``log``, each batch with its engine's rank."""
        self.kv_event_log = log
        for index, engine in enumerate(self.engines):
            engine.kv_event_log, engine.dp_rank = log, index

    # --- facts -------------------------------------------------------------------------------

    @property
    def model_info(self) -> ModelInfo:
        return self.engines[0].model_info

    @property
    def device(self) -> str:
        return self.engines[0].device

    @property
    def pids(self) -> list[int | None]:
        return [engine.pid for engine in self.engines]

    @property
    def pid(self) -> int | None:
        return self.engines[0].pid

    @property
    def is_running(self) -> bool:
        return self.dead_error is None and all(engine.is_running for engine in self.engines)

    @property
    def engine_stats(self) -> list[EngineStats]:
        """Each engine's own figures, in engine order."""
        return [engine.stats for engine in self.engines]

    @property
    def stats(self) -> EngineStats:
        """The engines' figures together (``sum_stats``)."""
        return sum_stats(self.engine_stats)

    @property
    def is_sleeping(self) -> bool:
        return all(engine.is_sleeping for engine in self.engines)

    @property
    def stall_timeout_s(self) -> float | None:
        return self.engines[0].stall_timeout_s

    @stall_timeout_s.setter
    def stall_timeout_s(self, value: float | None) -> None:
        for engine in self.engines:
            engine.stall_timeout_s = value

    @property
    def stalled(self) -> bool:
        """Every engine has stalled."""
        return all(self.engine_stalls)

    @property
    def engine_stalls(self) -> list[bool]:
        """Whether each engine has stalled, in engine order."""
        return [engine.stalled for engine in self.engines]

    @property
    def num_requests_in_flight(self) -> int:
        return len(self._owners)

    @property
    def figures_age_s(self) -> float:
        """The oldest engine's figures' age."""
        return max(engine.figures_age_s for engine in self.engines)

    @property
    def engine_figures_ages(self) -> list[float]:
        return [engine.figures_age_s for engine in self.engines]

    def engine_of(self, request_id: str) -> int | None:
        """The engine serving a live request (None once it has ended)."""
        return self._owners.get(request_id)

    # --- requests ----------------------------------------------------------------------------

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """As ``EngineClient.generate``, on the engine the balancer chooses (``pinned_rank``'s,
        where set)."""
        if self.dead_error is not None:
            raise EngineDeadError(str(self.dead_error))
        if request_id in self._owners:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in use")
        index = pinned_rank.get()
        if index is None:
            stalls = self.engine_stalls
            index = self.balancer.choose(prompt_token_ids, [i for i, s in enumerate(stalls) if s])
        elif not 0 <= index < len(self.engines):
            raise InvalidRequestError(
                "data_parallel_rank", f"must be in [0, {len(self.engines)}), got {index}"
            )
        self._owners[request_id] = index
        self.balancer.started(index, params.n)
        try:
            async for output in self.engines[index].generate(request_id, prompt_token_ids, params):
                yield output
        finally:
            self.balancer.finished(index, params.n)
            del self._owners[request_id]

    async def embed(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> RequestOutput:
        outputs = [output async for output in self.generate(request_id, prompt_token_ids, params)]
        return outputs[-1] if outputs else None

    async def abort(self, request_ids: Iterable[str]) -> list[str]:
        """Each live request's abort goes to the engine holding it; returns those aborted."""
        by_engine: dict[int, list[str]] = {}
        for request_id in request_ids:
            index = self._owners.get(request_id)
            if index is not None:
                by_engine.setdefault(index, []).append(request_id)
        answers = await asyncio.gather(
            *(self.engines[index].abort(ids) for index, ids in by_engine.items())
        )
        return [request_id for aborted in answers for request_id in aborted]

    async def warmup(self, prompt_token_ids: list[int] | None = None) -> None:
        """One short request end to end on every engine."""
        await asyncio.gather(*(engine.warmup(prompt_token_ids) for engine in self.engines))

    # --- admin: every engine ---------------------------------------------------------------------

    async def reset_prefix_cache(self) -> bool:
        """Every engine's prefix cache; False if any engine's requests hold KV blocks."""
        answers = await self._on_all(lambda engine: engine.reset_prefix_cache())
        return all(answers)

    async def sleep(self, level: int = 1) -> None:
        """Every engine sleeps, or none: those that slept wake again if one refuses."""
        await self._all_or_undo(lambda e: e.sleep(level), lambda e: e.wake_up())

    async def wake_up(self) -> None:
        await self._on_all(lambda engine: engine.wake_up())

    async def load_lora_adapter(self, name: str, path: str, base_model_name: str = "") -> dict:
        """Loaded on every engine, or on none (unloaded again where one fails); engine 0's
        entry."""
        entries = await self._all_or_undo(
            lambda e: e.load_lora_adapter(name, path, base_model_name),
            lambda e: e.unload_lora_adapter(name),
        )
        return entries[0]

    async def unload_lora_adapter(self, name: str) -> None:
        await self._on_all(lambda engine: engine.unload_lora_adapter(name))

    async def list_lora_adapters(self) -> list[dict]:
        """Engine 0's list: adapters are loaded on every engine or on none."""
        return await self.engines[0].list_lora_adapters()

    def call_utility(self, name: str, *args) -> asyncio.Future:
        """``EngineClient.call_utility`` on engine 0 (``engines[i].call_utility`` for another)."""
        return self.engines[0].call_utility(name, *args)

    async def _on_all(self, call) -> list:
        """``call(engine)`` on every engine at once; raises the first engine's error."""
        return list(await asyncio.gather(*(call(engine) for engine in self.engines)))

    async def _all_or_undo(self, call, undo) -> list:
        """``call`` on every engine; if any raises, ``undo`` where it succeeded, then raise."""
        results = await asyncio.gather(
            *(call(engine) for engine in self.engines), return_exceptions=True
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if not errors:
            return results
        done = [
            e
            for e, r in zip(self.engines, results, strict=True)
            if not isinstance(r, BaseException)
        ]
        await asyncio.gather(*(undo(engine) for engine in done), return_exceptions=True)
        raise errors[0]

    # --- life and death ------------------------------------------------------------------------

    async def shutdown(self) -> None:
        await asyncio.gather(*(engine.shutdown() for engine in self.engines))

    def _engine_died(self, index: int, error: BaseException) -> None:
        """One engine died: the client is dead (its requests on the others finish or are cut
        when the server stops them)."""
        if self.dead_error is not None:
            return
        self.dead_error = EngineDeadError(f"data-parallel engine {index}: {error}")
        if self.kv_event_log is not None:
            self.kv_event_log.end(self.dead_error)
        for callback in self.on_dead:
            callback(self.dead_error)


def _check_devices(engines: list[EngineProcessClient]) -> None:
    """Every engine on the same kind of device (a machine with fewer GPUs than engines would
    put the rest on the CPU)."""
    kinds = [engine.device.split(":")[0] for engine in engines]
    if len(set(kinds)) > 1:
        devices = ", ".join(f"engine {i}: {engine.device}" for i, engine in enumerate(engines))
        raise ValueError(
            f"--data-parallel-size {len(engines)}: the engines landed on different devices "
            f"({devices}); each engine needs a GPU of its own, or use --device cpu"
        )


def sum_stats(stats: list[EngineStats]) -> EngineStats:
    """Counts, blocks, bytes and throughputs added; the prefix cache hit rate and device
    utilization averaged; asleep only if every engine is."""
    total = {
        name: sum(getattr(s, name) for s in stats)
        for name in (
            "num_running",
            "num_waiting",
            "num_free_blocks",
            "num_total_blocks",
            "generation_throughput",
            "prompt_throughput",
            "kv_cache_bytes",
            "device_memory_used_bytes",
            "device_memory_total_bytes",
        )
    }
    utilizations = [s.device_utilization for s in stats if s.device_utilization is not None]
    spec = [s.spec_decode for s in stats if s.spec_decode is not None]
    return dataclasses.replace(
        stats[0],
        **total,
        prefix_cache_hit_rate=sum(s.prefix_cache_hit_rate for s in stats) / len(stats),
        is_sleeping=all(s.is_sleeping for s in stats),
        device_utilization=sum(utilizations) / len(utilizations) if utilizations else None,
        spec_decode=functools.reduce(operator.add, spec) if spec else None,
    )
