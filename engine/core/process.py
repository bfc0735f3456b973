"""The engine core's step loop, and the engine process that runs it (``python -m`` this module).

``EngineLoop`` is the one step loop of both modes: it takes commands (``messages.ToCore``)
between steps, steps while requests are unfinished, and sends outputs, results and figures
(``messages.FromCore``) back. ``AsyncEngine`` runs it on a thread of the server's process
(``--disable-frontend-multiprocessing``); ``EngineProcessClient`` starts this module's ``main``
as a process of its own, which talks to the frontend over two ZeroMQ IPC sockets in msgpack.

The engine process reads a ``Startup`` message from its standard input and keeps that pipe
open: when the frontend's process ends, however it ends, the pipe closes and the engine
process exits, so it never outlives the server. It ignores SIGINT (a terminal's Ctrl-C
signals the whole process group; the frontend decides). While it loads the model, SIGTERM
stops it the way an exception would, so a conversion under way removes its folder; once it
serves, it ignores SIGTERM too (a service manager may signal the whole group): the frontend
drains its calls, then tells the engine to stop.
"""

from __future__ import annotations

import logging
import os
import signal
import struct
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec

from llmrpc.engine import messages
from llmrpc.engine.core import plugins
from llmrpc.engine.memory import limit_arenas, release_free_memory
from llmrpc.engine.messages import (
    Abort,
    AddRequest,
    Call,
    Fatal,
    Figures,
    KVEvents,
    Log,
    Outputs,
    Ready,
    Result,
    Shutdown,
    Snapshot,
    Startup,
)

if TYPE_CHECKING:
    from llmrpc.engine.core.engine_core import EngineCore

logger = logging.getLogger(__name__)

# How often an idle engine refreshes its published figures: its heartbeat while idle (the
# frontend counts on it to tell an idle engine from a frozen one: async_engine.IDLE_STALL_MIN_S).
STATS_REFRESH_S = 1.0
# How often an idle engine gives the allocator's free memory back to the system.
IDLE_TRIM_INTERVAL_S = 10.0
# Utility commands a frontend may call by name (``Call.method``): the core's own methods, and
# those engine plug-ins register.
UTILITIES = ("reset_prefix_cache", "sleep", "wake_up")
UTILITIES += ("load_lora_adapter", "unload_lora_adapter", "list_lora_adapters")

Receive = Callable[[float], object]  # timeout in seconds (0: do not wait) -> a message or None
Send = Callable[[object], None]


class EngineLoop:
    """Runs an ``EngineCore``: commands between steps, steps while requests are unfinished.

    ``wrap_error`` turns an exception a command raised into what ``Result.error`` carries: an
    ``ErrorInfo`` to cross a process boundary, or the exception itself within one process.
    """

    def __init__(self, core: EngineCore, send: Send, wrap_error=messages.error_info) -> None:
        self.core = core
        self._send = send
        self._wrap_error = wrap_error

    def snapshot(self) -> Snapshot:
        return Snapshot(self.core.stats, str(self.core.runner.device))

    def run(self, receive: Receive) -> None:
        """Until a ``Shutdown`` arrives; raises what kills the step loop (a failed forward pass)."""
        core = self.core
        busy = False  # stepped since the engine last went idle
        last_trim = time.monotonic()
        while self._handle_commands(receive, wait=not core.has_unfinished_requests):
            if core.has_unfinished_requests:
                outputs = core.step()
                self._send(Outputs(outputs, self.snapshot()))
                self._send_kv_events()
                busy = True
                continue
            self._send(Figures(self.snapshot()))  # idle: throughput figures decay
            # What a load took can go back: when the engine goes idle, and every so often
            # while idle (large requests refused before reaching the engine use memory too).
            if busy or time.monotonic() - last_trim >= IDLE_TRIM_INTERVAL_S:
                release_free_memory()
                busy, last_trim = False, time.monotonic()

    def _handle_commands(self, receive: Receive, wait: bool) -> bool:
        """Apply the commands waiting; False once told to stop. Waiting for one (``wait``) ends
        after ``STATS_REFRESH_S`` without one."""
        timeout = STATS_REFRESH_S if wait else 0.0
        while (message := receive(timeout)) is not None:
            timeout = 0.0
            if isinstance(message, Shutdown):
                return False
            self._apply(message)
        return True

    def _send_kv_events(self) -> None:
        """The prefix cache's changes since the last send, if any (--kv-events-config)."""
        events = self.core.take_kv_events()
        if events:
            self._send(KVEvents(events, time.time()))

    def _apply(self, message) -> None:
        try:
            value = self._run_command(message)
        except Exception as error:  # noqa: BLE001 - returned to the caller
            self._send_kv_events()
            if message.call_id:
                self._send(Result(message.call_id, self.snapshot(), error=self._wrap_error(error)))
            else:
                logger.warning("a command without a caller failed: %r", error)
            return
        self._send_kv_events()
        if message.call_id:
            try:
                self._send(Result(message.call_id, self.snapshot(), value))
            except TypeError as error:  # msgpack has no form for it (a plug-in's result)
                error = TypeError(f"the result cannot be sent back: {error}")
                self._send(Result(message.call_id, self.snapshot(), error=self._wrap_error(error)))

    def _run_command(self, message):
        core = self.core
        if isinstance(message, AddRequest):
            return core.add_request(message.request_id, message.prompt_token_ids, message.params)
        if isinstance(message, Abort):
            outputs = core.abort_requests(message.request_ids)
            if outputs:
                self._send(Outputs(outputs, self.snapshot()))
            return [output.request_id for output in outputs]
        if isinstance(message, Call):
            utility = plugins.utility(message.method)
            if utility is not None:
                return utility(core, *message.args)
            if message.method not in UTILITIES:
                raise ValueError(f"no engine utility named {message.method!r}")
            return getattr(core, message.method)(*message.args)
        raise TypeError(f"not a command: {message!r}")


# --- the engine process ------------------------------------------------------------------------


class _Channel:
    """The engine process's two sockets: commands in, messages out (any thread may send)."""

    def __init__(self, startup: Startup) -> None:
        import zmq

        self._zmq = zmq
        self._context = zmq.Context(io_threads=1)
        self._commands = self._context.socket(zmq.PULL)
        self._commands.connect(startup.to_core)
        self._out = self._context.socket(zmq.PUSH)
        self._out.setsockopt(zmq.SNDHWM, 0)  # never block the step loop on a slow reader
        self._out.connect(startup.from_core)
        self._lock = threading.Lock()
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(messages.ToCore)

    def send(self, message) -> None:
        data = self._encoder.encode(message)
        with self._lock:
            self._out.send(data, copy=False)

    def receive(self, timeout: float):
        if timeout and not self._commands.poll(int(timeout * 1000)):
            return None
        try:
            data = self._commands.recv(self._zmq.NOBLOCK, copy=False)
        except self._zmq.Again:
            return None
        return self._decoder.decode(data.buffer)

    def close(self) -> None:
        """Close, giving queued messages up to 5 s to reach the frontend."""
        self._commands.close(linger=0)
        self._out.close(linger=5000)
        self._context.term()


class _ForwardingHandler(logging.Handler):
    """Sends each log record to the frontend, whose logging emits it."""

    def __init__(self, send: Send) -> None:
        super().__init__()
        self._forward = send

    def emit(self, record: logging.LogRecord) -> None:
        try:
            exc_text = record.exc_text
            if record.exc_info and not exc_text:
                exc_text = logging.Formatter().formatException(record.exc_info)
            self._forward(
                Log(
                    record.name,
                    record.levelno,
                    record.levelname,
                    record.getMessage(),
                    record.created,
                    record.pathname,
                    record.lineno,
                    record.funcName or "",
                    exc_text,
                )
            )
        except Exception:  # noqa: BLE001 - logging must never raise
            self.handleError(record)


def _read_startup(stream) -> Startup:
    (size,) = struct.unpack(">I", _read_exactly(stream, 4))
    return msgspec.msgpack.decode(_read_exactly(stream, size), type=Startup)


def _read_exactly(stream, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = stream.read(size - len(data))
        if not chunk:
            os._exit(0)  # the frontend is gone before it said what to run
        data += chunk
    return data


# Once the frontend is gone, how long a load under way gets to stop cleanly (SIGTERM).
STOP_LOADING_GRACE_S = 10.0


def _exit_when_the_frontend_exits(stream) -> None:
    """Block on the pipe from the frontend; its end is the end of the frontend's process.
    Loading, stop as SIGTERM would (clean-up included), for a while; serving, at once."""
    while stream.read(65536):
        pass
    if signal.getsignal(signal.SIGTERM) is _stop_loading:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(STOP_LOADING_GRACE_S)
    os._exit(0)


def _stop_loading(signum, frame) -> None:
    raise SystemExit(f"stopped by {signal.Signals(signum).name} while loading the model")


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _stop_loading)
    stdin = sys.stdin.buffer.raw if hasattr(sys.stdin.buffer, "raw") else sys.stdin.buffer
    startup = _read_startup(stdin)
    threading.Thread(
        target=_exit_when_the_frontend_exits, args=(stdin,), name="llmrpc-parent-watch", daemon=True
    ).start()
    limit_arenas()
    channel = _Channel(startup)
    root = logging.getLogger()
    root.handlers[:] = [_ForwardingHandler(channel.send)]
    root.setLevel(startup.log_level)
    try:
        plugins.load()  # before the model: a plug-in that cannot be imported costs no load
        from llmrpc.engine.core.engine_core import (
            EngineCore,  # torch: loaded here, not in the frontend
        )

        core = EngineCore(startup.config)
        core.use_idle_cores()  # this process's CPU time is the engine's alone
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # serving: the frontend stops it
    except BaseException as error:  # noqa: BLE001 - reported to the frontend
        from llmrpc.engine.loading import loader

        loader.remove_own_conversions()  # this process ends with os._exit: no at-exit handlers
        channel.send(Fatal(messages.error_info(error, with_traceback=True), while_loading=True))
        channel.close()
        return 1
    loop = EngineLoop(core, channel.send)
    channel.send(Ready(core.model_info, loop.snapshot()))
    try:
        loop.run(channel.receive)
    except BaseException as error:  # noqa: BLE001 - any failure here kills the engine
        logger.exception("engine step loop died")
        channel.send(Fatal(messages.error_info(error, with_traceback=False), while_loading=False))
        channel.close()
        return 1
    channel.close()
    return 0


if __name__ == "__main__":
    status = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # no interpreter teardown (torch's takes a second): nothing is left to save
