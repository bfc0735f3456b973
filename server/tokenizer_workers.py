"""Tokenizer work off the event loop: a few worker threads, each with its own tokenizer.

Tokenizing a long prompt, rendering a chat template or decoding many tokens takes time that
grows with the input; on the event loop it would stall every other call, health checks
included. Hugging Face's fast tokenizers are not safe to share between threads ("Already
borrowed"), so every thread that tokenizes owns a copy: each worker here, the event loop (for
small, bounded work), and the engine core (detokenization), wherever it runs. The server's
``Tokenization`` owns the one set of workers.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import threading
from collections.abc import Callable
from typing import TypeVar

_T = TypeVar("_T")

NUM_WORKERS = 2


class TokenizerWorkers:
    def __init__(self, tokenizer, num_workers: int = NUM_WORKERS) -> None:
        # One copy per worker, made now on the calling thread: the original is never shared.
        self._copies = [copy.deepcopy(tokenizer) for _ in range(num_workers)]
        self._all = list(self._copies)
        self._threads: list[threading.Thread] = []
        self._local = threading.local()
        self._lock = threading.Lock()
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=num_workers,
            thread_name_prefix="llmrpc-tokenizer",
            initializer=self._claim_copy,
        )

    def _claim_copy(self) -> None:
        with self._lock:
            self._local.tokenizer = self._copies.pop()
            self._threads.append(threading.current_thread())

    def _call(self, work: Callable[..., _T], args) -> _T:
        return work(self._local.tokenizer, *args)

    async def run(self, work: Callable[..., _T], *args) -> _T:
        """``work(tokenizer, *args)`` on a worker thread with that thread's own tokenizer.

        A caller cancelled meanwhile stops waiting; the worker finishes and its result is
        dropped.
        """
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._call, work, args)

    @property
    def threads(self) -> frozenset[threading.Thread]:
        """The worker threads started so far."""
        with self._lock:
            return frozenset(self._threads)

    def set_chat_template(self, template: str) -> None:
        """At start-up, before serving: the template every copy renders chats with."""
        for tokenizer in self._all:
            tokenizer.chat_template = template

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
