"""The frontend's tokenizers: the server tokenizes prompts and renders chats in its own process,
and the engine receives token ids.

One set per server, whatever ``--data-parallel-size``: the event loop's own tokenizer, for small
bounded work (one token's text), and ``TokenizerWorkers`` for work that grows with the input
(prompts, chat templates, Detokenize), each worker with its own copy. The engine core loads its
own tokenizer where it runs, for detokenization and stop strings. With
``--skip-tokenizer-init`` there is no tokenizer: ``run`` calls its work at once with None.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

from llmrpc.engine.config import EngineConfig
from llmrpc.engine.core_types import ModelInfo
from llmrpc.engine.loading import loader
from llmrpc.server.tokenizer_workers import NUM_WORKERS, TokenizerWorkers

_T = TypeVar("_T")


def tokenizer_path(config: EngineConfig, model_info: ModelInfo) -> str | None:
    """Where the engine's tokenizer comes from: ``--tokenizer``, else the model's folder as the
    engine resolved it (None with ``--skip-tokenizer-init``)."""
    if config.model.skip_tokenizer_init:
        return None
    return config.model.tokenizer or model_info.model_dir


class Tokenization:
    def __init__(self, tokenizer, num_workers: int = NUM_WORKERS) -> None:
        self.tokenizer = tokenizer  # the event loop's; the workers get copies of it
        self.workers = None if tokenizer is None else TokenizerWorkers(tokenizer, num_workers)

    @classmethod
    async def load(cls, path: str | None) -> Tokenization:
        """The tokenizer at ``path`` (None: none), loaded and copied off the event loop."""
        if path is None:
            return cls(None)
        return await asyncio.to_thread(lambda: cls(loader.load_tokenizer(path)))

    async def run(self, work: Callable[..., _T], *args) -> _T:
        """``work(tokenizer, *args)`` off the event loop, on a worker with its own tokenizer
        (at once, with None, for a server without a tokenizer)."""
        if self.workers is None:
            return work(None, *args)
        return await self.workers.run(work, *args)

    def set_chat_template(self, template: str) -> None:
        """``--chat-template``: at start-up, the template every copy renders chats with."""
        if self.tokenizer is None:
            raise ValueError(
                "--chat-template needs a tokenizer; this server has none (--skip-tokenizer-init)"
            )
        self.tokenizer.chat_template = template
        self.workers.set_chat_template(template)

    def shutdown(self) -> None:
        if self.workers is not None:
            self.workers.shutdown()
