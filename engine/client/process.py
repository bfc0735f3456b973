"""``EngineProcessClient``: the engine core in a process of its own, behind the same surface as
``AsyncEngine``.

The engine process (``python -m llmrpc.engine.core.process``) loads the model and runs the
step loop, detokenization and stop matching included, so none of that holds this process's
GIL, which grpc.aio, the REST gateway and the tokenizer workers share. Commands go to it and
outputs, results, figures and log records come back as msgspec messages (msgpack) over two
ZeroMQ IPC sockets in a private temporary folder; a thread here receives them and hands them
to the event loop in batches. This client loads no tokenizer: the server tokenizes
(``server/tokenization.py``) and sends token ids.

If the engine process ends unasked (a crash, ``kill -9``, the step loop dying), every request
in flight fails with ``EngineDeadError`` and ``on_dead`` is told the cause. ``shutdown`` asks it
to stop and waits for it; if this process ends first, the engine process sees its standard
input close and exits too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import weakref

import msgspec
import zmq

from llmrpc.engine.client.async_engine import EngineClient
from llmrpc.engine.client.kv_events import KVEventLog
from llmrpc.engine.config import EngineConfig
from llmrpc.engine.core.process import IDLE_TRIM_INTERVAL_S
from llmrpc.engine.memory import release_free_memory
from llmrpc.engine.messages import (
    EngineDeadError,
    Fatal,
    FromCore,
    Log,
    Ready,
    Shutdown,
    Startup,
    rebuild_error,
)

logger = logging.getLogger(__name__)

# How long a stopping engine process gets to finish its step and exit before it is killed.
SHUTDOWN_TIMEOUT_S = 30.0
# How often the receiving thread checks, while no message comes, that the process still runs.
LIVENESS_POLL_MS = 50


def describe_exit(pid: int, returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"the engine process (pid {pid}) was killed by {name}"
    return f"the engine process (pid {pid}) exited with status {returncode}"


class EngineProcessClient(EngineClient):
    def __init__(self) -> None:
        super().__init__()
        self._process: subprocess.Popen | None = None
        self._folder: str | None = None
        self._context: zmq.Context | None = None
        self._to_core: zmq.Socket | None = None
        self._from_core: zmq.Socket | None = None
        self._receiver: threading.Thread | None = None
        self._encoder = msgspec.msgpack.Encoder()
        self._ready: asyncio.Future | None = None
        self._stopping = False
        self._loaded = False  # the engine process has said Ready
        self._returncode: int | None = None
        self._busy = False  # requests since this process last trimmed its memory
        self._last_trim = time.monotonic()

    @classmethod
    async def create(
        cls, config: EngineConfig, env: dict[str, str] | None = None
    ) -> EngineProcessClient:
        """Start the engine process (with environment ``env``, default this process's) and wait
        until its model is loaded; raises what loading raised there (a ``ValueError`` naming a
        flag stays one)."""
        client = cls()
        client.kv_event_log = KVEventLog.for_config(config)
        client._loop = asyncio.get_running_loop()
        client._ready = client._loop.create_future()
        try:
            client._start(config, env)
            ready: Ready = await client._ready
            client._model_info = ready.model_info
            client._snapshot = ready.snapshot
        except BaseException:
            await client._stop()
            raise
        return client

    @property
    def pid(self) -> int | None:
        """The engine process's id."""
        return None if self._process is None else self._process.pid

    @property
    def is_running(self) -> bool:
        return self._process is not None and self._returncode is None and self.dead_error is None

    async def shutdown(self) -> None:
        await self._stop()

    # --- starting and stopping ------------------------------------------------------------------

    def _start(self, config: EngineConfig, env: dict[str, str] | None = None) -> None:
        self._folder = tempfile.mkdtemp(prefix="llmrpc-engine-")  # mode 0700: ours alone
        weakref.finalize(self, shutil.rmtree, self._folder, ignore_errors=True)
        to_core = f"ipc://{os.path.join(self._folder, 'to-core')}"
        from_core = f"ipc://{os.path.join(self._folder, 'from-core')}"
        self._context = zmq.Context(io_threads=1)
        self._to_core = self._context.socket(zmq.PUSH)
        self._to_core.setsockopt(zmq.SNDHWM, 0)
        self._to_core.setsockopt(zmq.LINGER, 0)
        self._to_core.bind(to_core)
        self._from_core = self._context.socket(zmq.PULL)
        self._from_core.setsockopt(zmq.RCVHWM, 0)
        self._from_core.setsockopt(zmq.LINGER, 0)
        self._from_core.bind(from_core)
        # Records at INFO and above always cross (the frontend's logging filters them as its
        # own); DEBUG ones only when the frontend would show some.
        level = min(logging.INFO, logging.getLogger("llmrpc").getEffectiveLevel())
        startup = Startup(to_core, from_core, config, level)
        self._process = subprocess.Popen(
            [sys.executable, "-m", "llmrpc.engine.core.process"],
            stdin=subprocess.PIPE,
            close_fds=True,
            env=env,
        )
        data = msgspec.msgpack.encode(startup)
        self._process.stdin.write(struct.pack(">I", len(data)) + data)
        self._process.stdin.flush()  # the pipe stays open: its end tells the process we ended
        logger.info("engine process started (pid %d)", self._process.pid)
        self._receiver = threading.Thread(
            target=self._receive_forever, name="llmrpc-engine-receiver", daemon=True
        )
        self._receiver.start()

    async def _stop(self) -> None:
        """Stop the engine process: told to once it serves; while it loads, by SIGTERM (its
        at-exit clean-up runs: a conversion under way removes its folder). Killed if it has
        not ended after ``SHUTDOWN_TIMEOUT_S``."""
        process = self._process
        if self._stopping:
            return
        self._stopping = True
        if process is None:  # it never started
            self._close_sockets()
            return
        if process.poll() is None:
            with contextlib.suppress(zmq.ZMQError):
                self._to_core.send(self._encoder.encode(Shutdown()), zmq.NOBLOCK)
            if not self._loaded:
                process.terminate()
            try:
                await asyncio.to_thread(process.wait, SHUTDOWN_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                logger.warning("the engine process did not stop in %.0f s", SHUTDOWN_TIMEOUT_S)
        if process.poll() is None:
            process.kill()
        await asyncio.to_thread(process.wait)
        if self._receiver is not None:
            await asyncio.to_thread(self._receiver.join)
        with contextlib.suppress(OSError):
            process.stdin.close()
        self._returncode = process.returncode
        self._close_sockets()
        if self.dead_error is None:
            self._fail_pending(EngineDeadError("the engine has shut down"))

    def _close_sockets(self) -> None:
        for socket in (self._to_core, self._from_core):
            if socket is not None:
                socket.close()
        if self._context is not None:
            self._context.term()
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)

    # --- messages -------------------------------------------------------------------------

    def _send(self, message) -> None:
        if self._returncode is not None or self._stopping:
            raise EngineDeadError("the engine has shut down")
        try:
            self._to_core.send(self._encoder.encode(message), zmq.NOBLOCK)
        except zmq.ZMQError as error:  # no engine process on the other end any more
            raise EngineDeadError(f"the engine process cannot be reached: {error}") from None

    def _receive_forever(self) -> None:
        """On its own thread: the engine process's messages, handed to the event loop in
        batches; log records emitted here; then the process's end."""
        decoder = msgspec.msgpack.Decoder(FromCore)
        socket, process = self._from_core, self._process
        while True:
            try:
                if socket.poll(LIVENESS_POLL_MS):
                    self._take(socket, decoder)
                elif process.poll() is not None:
                    self._take(socket, decoder)  # what it sent before it ended
                    self._call_soon(self._on_exit, process.returncode)
                    return
            except Exception as error:  # noqa: BLE001 - a message we cannot read: a bug
                logger.exception("reading the engine process's messages failed; stopping it")
                cause = EngineDeadError(
                    f"a message from the engine process was unreadable: {error!r}"
                )
                self._call_soon(self._fail_all, cause)
                process.kill()

    def _take(self, socket: zmq.Socket, decoder: msgspec.msgpack.Decoder) -> None:
        batch = []
        while True:
            try:
                frame = socket.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            message = decoder.decode(frame.buffer)
            if isinstance(message, Log):
                _emit(message, self._process.pid)
            else:
                batch.append(message)
        if batch:
            self._call_soon(self._handle_all, batch)

    def _handle_all(self, batch: list) -> None:
        super()._handle_all(batch)
        if self._snapshot is not None:
            self._trim_when_idle(self._snapshot.stats)

    def _trim_when_idle(self, stats) -> None:
        """This process's free memory back to the system when the engine goes idle, and every
        so often while it stays idle (the engine process trims its own)."""
        if stats.num_running or stats.num_waiting or self._collectors:
            self._busy = True
            return
        now = time.monotonic()
        if self._busy or now - self._last_trim >= IDLE_TRIM_INTERVAL_S:
            self._busy, self._last_trim = False, now
            self._loop.run_in_executor(None, release_free_memory)

    def _handle(self, message) -> None:
        if isinstance(message, Ready):
            self._loaded = True
            if not self._ready.done():
                self._ready.set_result(message)
        elif isinstance(message, Fatal):
            error = rebuild_error(message.error)
            if message.while_loading:
                if not self._ready.done():
                    self._ready.set_exception(error)
            else:
                self._fail_all(error)
        else:
            super()._handle(message)

    def _on_exit(self, returncode: int) -> None:
        """The engine process has ended (its last messages handled before this)."""
        self._returncode = returncode
        if self._stopping:
            return
        cause = EngineDeadError(describe_exit(self._process.pid, returncode))
        if not self._ready.done():
            self._ready.set_exception(EngineDeadError(f"{cause} while loading the model"))
        else:
            self._fail_all(cause)  # unless a Fatal message already said why


def _emit(message: Log, pid: int) -> None:
    """Emit the engine process's log record through this process's logging."""
    target = logging.getLogger(message.name)
    if not target.isEnabledFor(message.levelno):
        return
    record = logging.getLogRecordFactory()(
        message.name,
        message.levelno,
        message.pathname,
        message.lineno,
        message.message,
        None,
        None,
        message.func_name,
    )
    record.created = message.created
    record.msecs = (message.created - int(message.created)) * 1000
    record.exc_text = message.exc_text
    record.process = pid
    record.processName = "llmrpc-engine"
    target.handle(record)
