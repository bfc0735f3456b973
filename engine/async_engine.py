"""``AsyncEngine``: the engine core's step loop on a thread of its own, outputs as async iterators.

The event loop never blocks on the model. Requests and aborts reach the loop thread through a
queue; outputs come back through ``call_soon_threadsafe`` into one collector per request, which
merges deltas when its consumer lags. A consumer that stops listening (a cancelled or expired
call) aborts its request, which frees its KV blocks at the next step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterable

from llmrpc.engine.config import EngineConfig
from llmrpc.engine.core import EngineCore, EngineStateError, EngineStats, ModelInfo
from llmrpc.engine.memory import release_free_memory
from llmrpc.engine.request import InvalidRequestError, RequestOutput, SamplingParams
from llmrpc.engine.tokenizer_workers import TokenizerWorkers

logger = logging.getLogger(__name__)


__all__ = ["AsyncEngine", "EngineDeadError", "EngineStateError"]


# How often an idle engine thread refreshes its published figures.
STATS_REFRESH_S = 1.0
# How often an idle engine thread gives the allocator's free memory back to the system.
IDLE_TRIM_INTERVAL_S = 10.0


class EngineDeadError(RuntimeError):
    """The step loop stopped on an error; no request can be served any more."""


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
        await self.ready.wait()
        self.ready.clear()
        if self.error is not None:
            raise self.error
        outputs = [self.pending[index] for index in sorted(self.pending)]
        self.pending.clear()
        return outputs


class AsyncEngine:
    """One thread owns everything torch does (model load and every step): PyTorch's CPU
    kernels keep a team of worker threads per calling thread, and two teams contend for the
    cores."""

    def __init__(self) -> None:
        self.core: EngineCore | None = None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._collectors: dict[str, _Collector] = {}
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.dead_error: BaseException | None = None
        self.on_dead: list = []  # callbacks run on the event loop when the step loop dies
        # The engine thread's tokenizer is its own; the event loop and the tokenizer workers
        # have copies (fast tokenizers must not be shared between threads).
        self._tokenizer = None
        self._workers: TokenizerWorkers | None = None
        self._stats: EngineStats | None = None  # published by the engine thread

    @classmethod
    async def create(cls, config: EngineConfig) -> AsyncEngine:
        """Load the model on the engine's own thread, then run the step loop there."""
        engine = cls()
        loaded: concurrent.futures.Future = concurrent.futures.Future()
        engine._loop = asyncio.get_running_loop()
        engine._thread = threading.Thread(
            target=engine._run, args=(config, loaded), name="llmrpc-engine", daemon=True
        )
        engine._thread.start()
        await asyncio.wrap_future(loaded)  # raises what loading raised
        return engine

    @property
    def tokenizer(self):
        """The event loop's own tokenizer, for small bounded work (single-token text)."""
        return self._tokenizer

    async def run_tokenizer(self, work, *args):
        """``work(tokenizer, *args)`` off the event loop, on a worker with its own tokenizer
        (at once, with None, for a server without a tokenizer)."""
        if self._workers is None:
            return work(None, *args)
        return await self._workers.run(work, *args)

    def set_chat_template(self, template: str) -> None:
        """``--chat-template``: the template the frontend renders chats with."""
        self._tokenizer.chat_template = template
        self._workers.set_chat_template(template)

    @property
    def model_info(self) -> ModelInfo:
        return self.core.model_info

    @property
    def device(self) -> str:
        """Where the model's weights live, as torch names it: "cpu", "cuda:0"..."""
        return str(self.core.runner.device)

    @property
    def stats(self) -> EngineStats:
        """The engine's figures as of its latest step or command (a snapshot the engine thread
        publishes whole, so readers on other threads never see it half-updated)."""
        return self._stats

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead_error is None

    async def shutdown(self) -> None:
        if self._workers is not None:
            self._workers.shutdown()
        if self._thread is not None and self._thread.is_alive():
            self._inbox.put(("stop",))
            await asyncio.to_thread(self._thread.join)

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
        collector = self._collectors[request_id] = _Collector()
        num_finished = 0
        try:
            await self._call("add_request", request_id, prompt_token_ids, params)
            while num_finished < params.n:
                for output in await collector.get():
                    num_finished += output.finished
                    yield output
        finally:
            finished = num_finished == params.n
            del self._collectors[request_id]
            if not finished and self.dead_error is None:
                self._inbox.put(("abort", [request_id], None))

    async def abort(self, request_ids: Iterable[str]) -> list[str]:
        """Abort the live requests among ``request_ids``; returns those that were live."""
        return await self._call("abort", list(request_ids))

    async def reset_prefix_cache(self) -> bool:
        """Forget cached prefixes; False while requests hold KV blocks."""
        return await self._call("reset_prefix_cache")

    async def sleep(self, level: int = 1) -> None:
        """Free memory while idle (``--enable-sleep-mode``); raises ``EngineStateError`` if busy."""
        await self._call("sleep", level)

    async def wake_up(self) -> None:
        await self._call("wake_up")

    @property
    def is_sleeping(self) -> bool:
        return self.core.sleep_level > 0

    async def warmup(self) -> None:
        """Run one short request end to end, so the first user request pays no start-up cost."""
        tokenizer = self.tokenizer
        prompt = (tokenizer.encode("Hello", add_special_tokens=False) if tokenizer else []) or [0]
        params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        async for _ in self.generate(f"llmrpc-warmup-{uuid.uuid4().hex}", prompt, params):
            pass

    async def _call(self, command: str, *args):
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put((command, *args, future))
        return await asyncio.wrap_future(future)

    # --- the loop thread -------------------------------------------------------------------

    def _run(self, config: EngineConfig, loaded: concurrent.futures.Future) -> None:
        try:
            self.core = EngineCore(config)
            if self.core.tokenizer is not None:
                self._tokenizer = copy.deepcopy(self.core.tokenizer)
                self._workers = TokenizerWorkers(self.core.tokenizer)
            self._publish_stats()
        except BaseException as error:  # noqa: BLE001 - handed to create()
            loaded.set_exception(error)
            return
        loaded.set_result(None)
        busy = False  # stepped since the engine last went idle
        last_trim = time.monotonic()
        try:
            while self._handle_commands(block=not self.core.has_unfinished_requests):
                if self.core.has_unfinished_requests:
                    outputs = self.core.step()
                    self._publish_stats()  # before the outputs: a caller sees both agree
                    self._deliver(outputs)
                    busy = True
                    continue
                self._publish_stats()  # idle: throughput figures decay
                # What a load took can go back: when the engine goes idle, and every so often
                # while idle (large requests refused before reaching the engine use memory too).
                if busy or time.monotonic() - last_trim >= IDLE_TRIM_INTERVAL_S:
                    release_free_memory()
                    busy, last_trim = False, time.monotonic()
        except BaseException as error:  # noqa: BLE001 - any failure here kills the engine
            logger.exception("engine step loop died")
            self._call_soon(self._fail_all, error)

    def _publish_stats(self) -> None:
        self._stats = self.core.stats

    def _handle_commands(self, block: bool) -> bool:
        """Apply queued adds and aborts; False once asked to stop. Waiting for one (``block``)
        ends after ``STATS_REFRESH_S`` without one."""
        while True:
            try:
                command = self._inbox.get(block=block, timeout=STATS_REFRESH_S if block else None)
            except queue.Empty:
                return True
            block = False
            if command[0] == "stop":
                return False
            future = command[-1]
            # A caller that gave up (cancelled call, passed deadline) cancelled its future while
            # the command waited here: skip the command; its abort, if any, follows it.
            if future is not None and not future.set_running_or_notify_cancel():
                continue
            try:
                result = self._apply(command[0], *command[1:-1])
            except Exception as error:  # noqa: BLE001 - returned to the caller
                if future is not None:
                    future.set_exception(error)
                continue
            finally:
                self._publish_stats()
            if future is not None:
                future.set_result(result)

    def _apply(self, command: str, *args):
        if command != "abort":  # add_request, reset_prefix_cache, sleep, wake_up
            return getattr(self.core, command)(*args)
        outputs = self.core.abort_requests(args[0])
        self._publish_stats()
        self._deliver(outputs)
        return [output.request_id for output in outputs]

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        if outputs:
            self._call_soon(self._dispatch, outputs)

    def _call_soon(self, callback, *args) -> None:
        """Run ``callback`` on the event loop, unless the loop has already closed."""
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the loop closed (the process is exiting): no one is listening
            logger.debug("event loop closed; %s dropped", getattr(callback, "__name__", callback))

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            collector = self._collectors.get(output.request_id)
            if collector is not None:
                collector.put(output)

    def _fail_all(self, error: BaseException) -> None:
        self.dead_error = error
        for collector in self._collectors.values():
            collector.fail(EngineDeadError(f"the engine stopped: {error}"))
        for callback in self.on_dead:
            callback(error)
