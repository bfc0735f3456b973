"""The engine as the server sees it: requests in, outputs out as async iterators, never blocking
the event loop on the model.

``EngineClient`` is the frontend's half, the same in both modes: one collector per request,
which merges deltas when its consumer lags; utility calls answered by id; the engine's figures
as of its latest message, and how old they are. A consumer that stops listening (a cancelled
or expired call) aborts its request, which frees its KV blocks at the next step. The engine
core's step loop (``core.process.EngineLoop``) runs either on a thread of this process
(``AsyncEngine``, here: ``--disable-frontend-multiprocessing``) or in a process of its own
(``client.process.EngineProcessClient``); the two exchange the same typed messages
(``messages``). Requests come as token ids: the server tokenizes and renders chats
(``server/tokenization.py``); the engine core detokenizes with its own tokenizer where it runs.

The step loop's messages are its heartbeat: ``Outputs`` after each step, ``Figures`` every
``STATS_REFRESH_S`` while idle, ``Result`` after each command. With ``stall_timeout_s`` set
(``--engine-stall-timeout``), the engine is ``stalled`` when requests are in flight and none
has come for that long since they started, or, idle, for that long and ``IDLE_STALL_MIN_S`` at
least: a process stopped (SIGSTOP), a step that does not return. The slow utilities (a weight
reload, an adapter read from disk) are not steps: while one runs, the engine is not stalled.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from typing import TYPE_CHECKING

from llmrpc.engine.client.kv_events import KVEventLog
from llmrpc.engine.config import EngineConfig
from llmrpc.engine.core import plugins
from llmrpc.engine.core.process import STATS_REFRESH_S, EngineLoop
from llmrpc.engine.core_types import EngineStateError, EngineStats, ModelInfo
from llmrpc.engine.messages import (
    Abort,
    AddRequest,
    Call,
    EngineDeadError,
    Figures,
    KVEvents,
    Outputs,
    Result,
    Shutdown,
    Snapshot,
    rebuild_error,
)
from llmrpc.engine.pooling.params import PoolingParams
from llmrpc.engine.request import InvalidRequestError, RequestOutput, SamplingParams

if TYPE_CHECKING:
    from llmrpc.engine.core.engine_core import EngineCore

logger = logging.getLogger(__name__)


__all__ = ["AsyncEngine", "EngineClient", "EngineDeadError", "EngineStateError"]

# An idle engine reports every STATS_REFRESH_S: silent this long (or the stall timeout, if
# longer) it is frozen, with margin for a busy machine's scheduling.
IDLE_STALL_MIN_S = 5 * STATS_REFRESH_S
# Utility commands that may hold the step loop for long without being a stuck step: waking
# from level 2 reloads the weights, loading an adapter reads it from disk.
SLOW_UTILITIES = frozenset({"sleep", "wake_up", "load_lora_adapter"})


class _Collector:
    """Outputs of one request not yet consumed, merged per sample while the consumer lags."""

    def __init__(self) -> None:
        self.pending: dict[int, RequestOutput] = {}  # sample index -> merged delta
        self.error: BaseException | None = None
        self.ready = asyncio.Event()

    def put(self, output: RequestOutput) -> None:
        earlier = self.pending.get(output.index)
        if earlier is None:
            self.pending[output.index] = output
        else:
            earlier.merge(output)
        self.ready.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.ready.set()

    async def get(self) -> list[RequestOutput]:
        """The outputs merged since the last call; once they are consumed, the error, if any
        (tokens made before a fault reach the caller before it)."""
        await self.ready.wait()
        if not self.pending and self.error is not None:
            raise self.error
        if self.error is None:
            self.ready.clear()
        outputs = [self.pending[index] for index in sorted(self.pending)]
        self.pending.clear()
        return outputs


class EngineClient:
    """What the server calls, whichever side of a process boundary the engine core is on.

    A subclass carries messages: ``_send`` hands one to the core (at once, in order), and the
    core's messages reach ``_handle`` on the event loop.
    """

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._collectors: dict[str, _Collector] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count(1)
        self.dead_error: BaseException | None = None
        self.on_dead: list = []  # callbacks run on the event loop when the engine dies
        self._model_info: ModelInfo | None = None
        self._snapshot: Snapshot | None = None
        # The heartbeat: when the step loop last sent a message, and when requests in flight
        # last went from none to some (a step starts then, however long ago the last beat).
        self.stall_timeout_s: float | None = None  # None: never stalled
        self._beat_at = self._busy_since = time.monotonic()
        self._slow_calls: set[int] = set()  # ids of SLOW_UTILITIES calls not yet answered
        # --kv-events-config: the prefix cache's events (shared by a data-parallel client's
        # engines, each batch with its engine's rank); None: not recorded
        self.kv_event_log: KVEventLog | None = None
        self.dp_rank: int | None = None

    # --- what a subclass provides -------------------------------------------------------------

    def _send(self, message) -> None:
        raise NotImplementedError

    @property
    def is_running(self) -> bool:
        raise NotImplementedError

    async def shutdown(self) -> None:
        raise NotImplementedError

    # --- the surface ------------------------------------------------------------------------

    @property
    def model_info(self) -> ModelInfo:
        return self._model_info

    @property
    def device(self) -> str:
        """Where the model's weights live, as torch names it: "cpu", "cuda:0"..."""
        return self._snapshot.device

    @property
    def stats(self) -> EngineStats:
        """The engine's figures as of its latest step or command (a snapshot it sends whole)."""
        return self._snapshot.stats

    @property
    def is_sleeping(self) -> bool:
        return self._snapshot.stats.is_sleeping

    @property
    def num_requests_in_flight(self) -> int:
        """Requests this frontend has given the engine and not yet seen end."""
        return len(self._collectors)

    @property
    def figures_age_s(self) -> float:
        """Seconds since the step loop last reported: the age of ``stats``."""
        return time.monotonic() - self._beat_at

    @property
    def stalled(self) -> bool:
        """Whether the step loop has been silent past its bound (see the module's docstring)."""
        timeout = self.stall_timeout_s
        if timeout is None or self._slow_calls or self.dead_error is not None:
            return False
        if not self._collectors:
            timeout = max(timeout, IDLE_STALL_MIN_S)
        return time.monotonic() - max(self._beat_at, self._busy_since) > timeout

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as deltas, per sample (``index``); each sample's last has
        ``finished`` set, and the iteration ends when all ``params.n`` samples have finished.

        Raises ``InvalidRequestError`` before the first output if the request is malformed.
        """
        if self.dead_error is not None:
            raise EngineDeadError(str(self.dead_error))
        if request_id in self._collectors:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in use")
        if not self._collectors:
            self._busy_since = time.monotonic()
        collector = self._collectors[request_id] = _Collector()
        num_finished = 0
        try:
            await self._call(lambda i: AddRequest(i, request_id, prompt_token_ids, params))
            while num_finished < params.n:
                for output in await collector.get():
                    num_finished += output.finished
                    yield output
        finally:
            finished = num_finished == params.n
            del self._collectors[request_id]
            if not finished and self.dead_error is None:
                self._post(Abort(0, [request_id]))

    async def embed(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> RequestOutput:
        """One pooling request (``params.pooling`` set) to its end: its one output, which
        carries the embedding (or the engine's error). Raises as ``generate`` does."""
        last = None
        async for output in self.generate(request_id, prompt_token_ids, params):
            last = output
        return last

    async def abort(self, request_ids: Iterable[str]) -> list[str]:
        """Abort the live requests among ``request_ids``; returns those that were live."""
        return await self._call(lambda call_id: Abort(call_id, list(request_ids)))

    async def reset_prefix_cache(self) -> bool:
        """Forget cached prefixes; False while requests hold KV blocks."""
        return await self._utility("reset_prefix_cache")

    async def sleep(self, level: int = 1) -> None:
        """Free memory while idle (``--enable-sleep-mode``); raises ``EngineStateError`` if busy."""
        await self._utility("sleep", level)

    async def wake_up(self) -> None:
        await self._utility("wake_up")

    async def load_lora_adapter(self, name: str, path: str, base_model_name: str = "") -> dict:
        """Load the PEFT adapter at ``path`` as ``name`` (``engine/lora/manager.py``)."""
        return await self._utility("load_lora_adapter", name, path, base_model_name)

    async def unload_lora_adapter(self, name: str) -> None:
        await self._utility("unload_lora_adapter", name)

    async def list_lora_adapters(self) -> list[dict]:
        """The loaded adapters: name, path, base_model_name, id ([] with LoRA off)."""
        return await self._utility("list_lora_adapters")

    def call_utility(self, name: str, *args) -> asyncio.Future:
        """Call the engine utility ``name`` (one the core has, ``core.process.UTILITIES``, or
        one an engine plug-in registered, ``core.plugins``) between two steps where
        the core lives; a future of its result, sent at once (commands sent later run after
        it). ``args`` and the result cross as plain data."""
        return self._call(
            lambda call_id: Call(call_id, name, list(args)), slow=name in SLOW_UTILITIES
        )

    async def warmup(self, prompt_token_ids: list[int] | None = None) -> None:
        """Run one short request end to end, so the first user request pays no start-up cost
        (``prompt_token_ids``: the frontend's tokens for it; token 0 without any)."""
        prompt = list(prompt_token_ids or []) or [0]
        params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        if self.model_info.runner == "pooling":  # a server that embeds only
            params = SamplingParams(max_tokens=None, pooling=PoolingParams())
        async for _ in self.generate(f"llmrpc-warmup-{uuid.uuid4().hex}", prompt, params):
            pass

    # --- messages ---------------------------------------------------------------------------

    async def _utility(self, method: str, *args):
        return await self.call_utility(method, *args)

    def _call(self, make_message: Callable[[int], object], slow: bool = False) -> asyncio.Future:
        """Send the command ``make_message(call_id)`` now; a future of its result. ``slow``:
        the step loop may be silent until it answers."""
        future = asyncio.get_running_loop().create_future()
        if self.dead_error is not None:
            future.set_exception(EngineDeadError(f"the engine stopped: {self.dead_error}"))
            return future
        call_id = next(self._call_ids)
        self._calls[call_id] = future
        if slow:
            self._slow_calls.add(call_id)
        try:
            self._send(make_message(call_id))
        except BaseException:
            del self._calls[call_id]
            self._slow_calls.discard(call_id)
            raise
        return future

    def _post(self, message) -> None:
        """Send a command no one waits on; dropped if the engine is gone."""
        with contextlib.suppress(EngineDeadError):
            self._send(message)

    def _handle(self, message) -> None:
        """A message from the engine core, on the event loop."""
        if isinstance(message, Outputs | Result | Figures):
            self._beat_at = time.monotonic()
        if isinstance(message, Outputs):
            self._snapshot = message.snapshot
            for output in message.outputs:
                collector = self._collectors.get(output.request_id)
                if collector is not None:
                    collector.put(output)
        elif isinstance(message, Result):
            self._snapshot = message.snapshot
            self._slow_calls.discard(message.call_id)
            future = self._calls.pop(message.call_id, None)
            if future is None or future.done():  # the caller gave up (a cancelled call)
                return
            if message.error is None:
                future.set_result(message.value)
            else:
                error = message.error
                future.set_exception(
                    error if isinstance(error, BaseException) else rebuild_error(error)
                )
        elif isinstance(message, Figures):
            self._snapshot = message.snapshot
        elif isinstance(message, KVEvents) and self.kv_event_log is not None:
            self.kv_event_log.append(message.events, message.timestamp, self.dp_rank)

    def _handle_all(self, batch: list) -> None:
        for message in batch:
            self._handle(message)

    def _fail_pending(self, error: BaseException) -> None:
        """Fail every request and call waiting on the engine with ``error``."""
        for collector in self._collectors.values():
            collector.fail(error)
        calls, self._calls = self._calls, {}
        self._slow_calls.clear()
        for future in calls.values():
            if not future.done():
                future.set_exception(error)

    def _fail_all(self, error: BaseException) -> None:
        """The engine died of ``error``: fail everything waiting on it, then tell ``on_dead``."""
        if self.dead_error is not None:
            return
        self.dead_error = error
        self._fail_pending(EngineDeadError(f"the engine stopped: {error}"))
        if self.kv_event_log is not None:
            self.kv_event_log.end(error)
        for callback in self.on_dead:
            callback(error)

    def _call_soon(self, callback, *args) -> None:
        """Run ``callback`` on the event loop from another thread, unless the loop has closed."""
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the loop closed (the process is exiting): no one is listening
            logger.debug("event loop closed; %s dropped", getattr(callback, "__name__", callback))


class AsyncEngine(EngineClient):
    """The engine core's step loop on a thread of this process.

    One thread owns everything torch does (model load and every step): PyTorch's CPU kernels
    keep a team of worker threads per calling thread, and two teams contend for the cores.
    Messages are handed over as objects: no encoding."""

    def __init__(self) -> None:
        super().__init__()
        self.core: EngineCore | None = None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    @classmethod
    async def create(cls, config: EngineConfig) -> AsyncEngine:
        """Load the model on the engine's own thread, then run the step loop there."""
        engine = cls()
        engine.kv_event_log = KVEventLog.for_config(config)
        loaded: concurrent.futures.Future = concurrent.futures.Future()
        engine._loop = asyncio.get_running_loop()
        engine._thread = threading.Thread(
            target=engine._run, args=(config, loaded), name="llmrpc-engine", daemon=True
        )
        engine._thread.start()
        loading = asyncio.wrap_future(loaded)
        try:
            await asyncio.shield(loading)  # raises what loading raised
        except asyncio.CancelledError:
            # Stopped while loading: the thread loads on (torch cannot be interrupted), then
            # takes the Shutdown. Joined here, so no torch work runs on as the process exits,
            # which would abort it ("terminate called without an active exception").
            engine._inbox.put(Shutdown())
            await asyncio.to_thread(engine._thread.join)
            if loading.done():
                loading.exception()  # a failed load, if it failed: nobody waits for it now
            raise
        return engine

    @property
    def device(self) -> str:
        return str(self.core.runner.device)  # read from the model at each call

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead_error is None

    async def shutdown(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._inbox.put(Shutdown())
            await asyncio.to_thread(self._thread.join)

    def _send(self, message) -> None:
        self._inbox.put(message)

    def _receive(self, timeout: float):
        try:
            return self._inbox.get(block=timeout > 0, timeout=timeout or None)
        except queue.Empty:
            return None

    # --- the engine thread ------------------------------------------------------------------

    def _run(self, config: EngineConfig, loaded: concurrent.futures.Future) -> None:
        from llmrpc.engine.core.engine_core import (
            EngineCore,  # torch: only where the engine runs in-process
        )

        try:
            plugins.load()  # the engine plug-ins, before the model (core.plugins)
            self.core = EngineCore(config)
            loop = EngineLoop(self.core, self._deliver, wrap_error=lambda error: error)
            self._model_info = self.core.model_info
            self._snapshot = loop.snapshot()
        except BaseException as error:  # noqa: BLE001 - handed to create()
            loaded.set_exception(error)
            return
        loaded.set_result(None)
        try:
            loop.run(self._receive)
        except BaseException as error:  # noqa: BLE001 - any failure here kills the engine
            logger.exception("engine step loop died")
            self._call_soon(self._fail_all, error)

    def _deliver(self, message) -> None:
        self._call_soon(self._handle, message)
