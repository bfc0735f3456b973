"""Compiling structured-output grammars against the vocabulary, off the engine's step.

Compiles run on two lanes of threads (``lanes.py``; xgrammar compiles in native code
with the GIL released, so threads compile side by side while the step goes on): grammars of at
most ``SMALL_GRAMMAR_CHARS`` characters (``json_object``, a usual schema, a short regex) on one,
bigger ones (long enums and choice lists, which take seconds to minutes) on the other; on each,
a compile that proves slow stops holding up the ones behind it, so a cheap grammar never queues
behind an expensive one. A grammar compiled before is answered from a cache at once, without a
lane; one asked for again while it compiles is compiled once.

Each request's grammar has ``timeout_s`` (``--structured-output-compile-timeout``) from its
arrival to be ready; past it the request's future fails with an ``InvalidRequestError`` naming
its field (INVALID_ARGUMENT, HTTP 400) and the rest go on. A compile nobody waits for any more
is dropped if it has not started; one already running cannot be stopped (neither library can
interrupt a compile), so it finishes on its lane and lands in the cache.
"""

from __future__ import annotations

import collections
import concurrent.futures
import heapq
import itertools
import logging
import threading
import time
from dataclasses import dataclass, replace

from llmrpc.engine.config import DEFAULT_COMPILE_TIMEOUT_S
from llmrpc.engine.request import InvalidRequestError, StructuredOutputSpec
from llmrpc.engine.structured_output.grammar import (
    _guidance_build,
    _xgrammar_build,
    field_name,
    first_buildable,
)
from llmrpc.engine.structured_output.lanes import CompileLane

logger = logging.getLogger(__name__)

SMALL_GRAMMAR_CHARS = 16_384  # a schema's JSON text, a regex, a grammar, the choices together
SMALL_LANE = (2, 4)  # threads for fast compiles, threads in all (lanes.py)
LARGE_LANE = (1, 2)
_COMPILED_CACHE_BYTES = 256 * 2**20


def grammar_chars(spec: StructuredOutputSpec) -> int:
    """The size of a constraint's text: what picks its lane."""
    return len(spec.value) + sum(map(len, spec.choices))


@dataclass(eq=False)
class _Job:
    """One compile, which any number of requests may wait for."""

    future: concurrent.futures.Future
    waiters: int = 0


class _CompiledCache:
    """The most recently used compiled grammars, up to a total size in bytes."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self._entries: collections.OrderedDict = collections.OrderedDict()
        self._bytes = 0

    def get(self, key):
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry[0]

    def put(self, key, result) -> None:
        if key in self._entries:
            return
        size = _size_bytes(result)
        self._entries[key] = (result, size)
        self._bytes += size
        while self._bytes > self.limit_bytes and len(self._entries) > 1:
            _, (_, dropped) = self._entries.popitem(last=False)
            self._bytes -= dropped


def _size_bytes(result) -> int:
    spec, compiled = result
    if spec.backend == "guidance":
        return len(compiled[1])  # the grammar's text; its tokenizer is shared
    return compiled.memory_size_bytes


class GrammarCompiler:
    """Compiles checked specs against the model's vocabulary on two lanes of threads."""

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.timeout_s = timeout_s
        self._xgrammar = None  # built on first use: reading the vocabulary takes ~0.2 s
        self._guidance = None
        self._vocabulary_lock = threading.Lock()
        self._small = CompileLane("grammar", *SMALL_LANE)
        self._large = CompileLane("grammar-large", *LARGE_LANE)
        # the jobs, the cache and the deadlines; reentrant: cancelling a job runs its callbacks
        self._lock = threading.RLock()
        self._deadline_added = threading.Condition(self._lock)
        self._jobs: dict[tuple, _Job] = {}
        self._cache = _CompiledCache(_COMPILED_CACHE_BYTES)
        self._deadlines: list = []  # heap of (deadline, order, request's future, job, spec)
        self._order = itertools.count()
        self._watcher: threading.Thread | None = None
        # the vocabulary's tables, built now so the first request need not wait for them
        self.warmed = self._small.submit(self._xgrammar_compiler)

    def submit(
        self, spec: StructuredOutputSpec, backend: str = "auto", fallback: bool = True
    ) -> concurrent.futures.Future:
        """A future of ``(spec, compiled)``: ``spec`` checked (``check``, unless it names its
        backend already) and compiled; an ``InvalidRequestError`` when it cannot be built or
        is not ready within ``timeout_s``."""
        # reasoning does not change the grammar: one compile serves every prompt
        key = (replace(spec, reasoning_end=(), reasoning_start=None), backend, fallback)
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                future.set_result(cached)
                return future
            job = self._jobs.get(key) or self._start(key)
            job.waiters += 1
            deadline = time.monotonic() + self.timeout_s
            heapq.heappush(self._deadlines, (deadline, next(self._order), future, job, spec))
            self._deadline_added.notify()
            self._start_watcher()
        job.future.add_done_callback(lambda done: _pass_on(done, future))
        return future

    def _start(self, key: tuple) -> _Job:
        spec, backend, fallback = key
        lane = self._small if grammar_chars(spec) <= SMALL_GRAMMAR_CHARS else self._large
        job = _Job(lane.submit(self._compile, spec, backend, fallback))
        self._jobs[key] = job
        job.future.add_done_callback(lambda done: self._finished(key, job))
        return job

    def _finished(self, key: tuple, job: _Job) -> None:
        with self._lock:
            if self._jobs.get(key) is job:
                del self._jobs[key]
            if not job.future.cancelled() and job.future.exception() is None:
                self._cache.put(key, job.future.result())

    def _start_watcher(self) -> None:
        if self._watcher is None:
            self._watcher = threading.Thread(
                target=self._watch_deadlines, name="grammar-deadlines", daemon=True
            )
            self._watcher.start()

    def _watch_deadlines(self) -> None:
        with self._lock:
            while True:
                now = time.monotonic()
                while self._deadlines and self._deadlines[0][0] <= now:
                    _, _, future, job, spec = heapq.heappop(self._deadlines)
                    self._expire(future, job, spec)
                wait = self._deadlines[0][0] - now if self._deadlines else None
                self._deadline_added.wait(wait)

    def _expire(self, future: concurrent.futures.Future, job: _Job, spec) -> None:
        """At a request's deadline: fail its future unless it is done; a compile that nobody
        waits for any more is dropped if it has not started."""
        job.waiters -= 1
        if not job.waiters and job.future.cancel():
            logger.info("a grammar compile nobody waits for was dropped before it started")
        if future.done():
            return
        message = (
            f"its grammar did not compile within {self.timeout_s:g} s "
            "(--structured-output-compile-timeout); a smaller constraint compiles faster"
        )
        _set(future, exception=InvalidRequestError(field_name(spec), message))

    def _compile(self, spec: StructuredOutputSpec, backend: str, fallback: bool):
        # An unchecked spec is checked by compiling it: building it first would do it twice.
        if spec.backend:
            return spec, self._build(spec)
        return first_buildable(spec, backend, fallback, self._build)

    def _build(self, spec: StructuredOutputSpec):
        if spec.backend == "guidance":
            return self._guidance_tokenizer(), _guidance_build(spec)
        return _xgrammar_build(spec, self._xgrammar_compiler())

    def _xgrammar_compiler(self):
        with self._vocabulary_lock:
            if self._xgrammar is None:
                import xgrammar

                info = xgrammar.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.eos_token_ids
                )
                self._xgrammar = xgrammar.GrammarCompiler(
                    info, max_threads=1, cache_limit_bytes=_COMPILED_CACHE_BYTES
                )
            return self._xgrammar

    def _guidance_tokenizer(self):
        with self._vocabulary_lock:
            if self._guidance is None:
                import llguidance.hf

                self._guidance = llguidance.hf.from_tokenizer(
                    self.tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_token_ids or None
                )
            return self._guidance


def _pass_on(done: concurrent.futures.Future, future: concurrent.futures.Future) -> None:
    """A finished compile's result (or error) to a request's future, unless it has expired."""
    if done.cancelled():
        return  # only once every request waiting for it has expired
    error = done.exception()
    if error is None:
        _set(future, result=done.result())
    else:
        _set(future, exception=error)


def _set(future: concurrent.futures.Future, result=None, exception=None) -> None:
    """Complete ``future`` unless it is already done (a compile and its deadline race)."""
    try:
        if exception is not None:
            future.set_exception(exception)
        else:
            future.set_result(result)
    except concurrent.futures.InvalidStateError:
        pass
