"""Logging: configuration, the request id on every line about a request, request and output
lines, and the periodic stats line.

The request id lives in a context variable that the request-id interceptor sets for the call's
task; a log record factory copies it onto every record as ``request_id`` (and ``request_tag``,
`` [id]`` or empty), so any formatter, ours or one from ``--log-config-file``, can show it.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import logging.config
from pathlib import Path

from llmrpc.server.settings import LogConfig

# Their own loggers, so a --log-config-file can route or silence them apart from the rest.
request_logger = logging.getLogger("llmrpc.requests")
stats_logger = logging.getLogger("llmrpc.stats")

LOG_FORMAT = "%(asctime)s.%(msecs)03d %(levelname)s %(name)s%(request_tag)s: %(message)s"
LOG_DATE_FORMAT = "%Y-%m-%d %H:%M:%S"

request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "llmrpc_request_id", default=None
)


def current_request_id() -> str | None:
    return request_id_var.get()


def escaped(text: str) -> str:
    """``text`` with control characters, backslashes and non-ASCII as Python escapes (``\\n``,
    ``\\x1b``, ``\\u00e9``): what a client sent can never start a log line of its own or
    drive a terminal. Ids are checked before they get here; this is the second line of defence."""
    if text.isascii() and text.isprintable() and "\\" not in text:
        return text
    return text.encode("unicode_escape").decode("ascii")


def _with_request_id(make_record):
    def make(*args, **kwargs) -> logging.LogRecord:
        record = make_record(*args, **kwargs)
        request_id = request_id_var.get()
        request_id = escaped(request_id) if request_id else None
        record.request_id = request_id or "-"
        record.request_tag = f" [{request_id}]" if request_id else ""
        return record

    make.adds_request_id = True
    return make


def install_request_id_records() -> None:
    """Give every log record ``request_id`` and ``request_tag`` (idempotent)."""
    factory = logging.getLogRecordFactory()
    if not getattr(factory, "adds_request_id", False):
        logging.setLogRecordFactory(_with_request_id(factory))


def configure_logging(config: LogConfig) -> None:
    """``--log-config-file`` (a dictConfig JSON) if given, else our format at ``--log-level``."""
    install_request_id_records()
    if config.config_file is None:
        logging.basicConfig(
            level=config.level.upper(), format=LOG_FORMAT, datefmt=LOG_DATE_FORMAT, force=True
        )
        return
    try:
        logging.config.dictConfig(json.loads(Path(config.config_file).read_text()))
    except (OSError, ValueError, TypeError) as error:
        raise ValueError(f"--log-config-file {config.config_file}: {error}") from None


# --- requests and outputs --------------------------------------------------------------------


def _cut(items, max_len: int | None):
    return items if max_len is None or items is None else items[:max_len]


def log_request(prompt: str | None, token_ids: list[int], params, max_len: int | None) -> None:
    """The ``--enable-log-requests`` line: prompt text (None for token ids or chat input) and
    token ids, each cut at ``--max-log-len``."""
    request_logger.info(
        "request: prompt %r, %d prompt tokens %s, params %s",
        _cut(prompt, max_len),
        len(token_ids),
        _cut(token_ids, max_len),
        params,
    )


def log_output(output, max_len: int | None) -> None:
    """The ``--enable-log-outputs`` line for a finished request's whole output."""
    request_logger.info(
        "output (%s): %r, %d tokens %s",
        output.finish_reason.name.lower(),
        _cut(output.text, max_len),
        len(output.token_ids),
        _cut(output.token_ids, max_len),
    )


# --- the stats line --------------------------------------------------------------------------


def stats_line(stats) -> str:
    return (
        f"{stats.num_running} running, {stats.num_waiting} waiting, "
        f"KV cache {stats.kv_cache_usage:.1%} used, "
        f"prefix cache hit rate {stats.prefix_cache_hit_rate:.1%}, "
        f"prompt {stats.prompt_throughput:.1f} tokens/s, "
        f"generation {stats.generation_throughput:.1f} tokens/s"
        + _speculation(stats.spec_decode)
        + (", asleep" if stats.is_sleeping else "")
    )


def _speculation(counts) -> str:
    """Speculative decoding since start: the share of drafts accepted, the tokens a step gave."""
    if counts is None or not counts.num_draft_tokens:
        return ""
    return (
        f", drafts accepted {counts.acceptance_rate:.1%} "
        f"(mean accepted length {counts.mean_accepted_length:.2f})"
    )


def _idle(stats) -> bool:
    return not (
        stats.num_running
        or stats.num_waiting
        or stats.prompt_throughput
        or stats.generation_throughput
    )


async def log_stats_forever(engine, interval_s: float) -> None:
    """A stats line every ``interval_s`` seconds; one line for a stretch of idleness, not many."""
    was_idle = False
    while True:
        await asyncio.sleep(interval_s)
        stats = engine.stats
        idle = _idle(stats)
        if not (idle and was_idle):
            stats_logger.info("engine: %s", stats_line(stats))
        was_idle = idle
