"""``make attack``: attacks that once took a real ``llmrpc serve`` down, run again on loopback.

A server with ``--api-key`` and a small open-file limit (so that exhausting it takes seconds,
not minutes) runs a tiny model; a monitor probes gRPC health and REST ``/health`` every 100 ms
on connections opened before the attacks, opens a fresh gRPC connection every second, and
samples the server's RSS. Each attack is bounded in count and time and prints one line:

    held      the server and every other client were unharmed
    degraded  what the attack targets slowed or refused others, as its bound intends
    failed    health was slow (over 200 ms) or failed, a fresh gRPC connection failed, memory
              grew past its bound, the log ran away, or the server died

The tool exits 1 on any failure. Run: ``python tests/robustness/attack.py [--only NAME ...]``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import multiprocessing
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attack_requests import ATTACKS as request_attacks  # noqa: E402
from attack_requests import KEY, OTHER_KEY  # noqa: E402
from soak import free_port, rss_mib, wait_serving  # noqa: E402

MODEL_NAME = "attack-model"
MAX_MODEL_LEN = 16384  # room for the long-prefill attack's prompt
STALL_TIMEOUT_S = 3.0  # --engine-stall-timeout: the frozen-engine attack waits it out
HEALTH_BOUND_S = 0.2
LOG_BOUND_BYTES = 256 * 1024  # what the server may log during one attack
RSS_BOUND_MIB = 200  # how much the server's resident memory may grow during one
GENERATE = "/llmrpc.v1.GenerationService/Generate"


@dataclass
class Monitor:
    """Health latencies, fresh-connection failures and RSS while an attack runs."""

    grpc_port: int
    rest_port: int
    pid: int
    latencies_s: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    num_fresh_connections: int = 0
    num_fresh_refused: int = 0
    peak_rss_mib: float = 0.0

    def reset(self) -> None:
        self.latencies_s.clear()
        self.failures.clear()
        self.num_fresh_connections = self.num_fresh_refused = 0
        self.peak_rss_mib = rss_mib(self.pid)

    def start(self):
        """Probe from a process of its own (the attackers' process is busy: its figures would
        be its own) until ``stop``; the figures come back then."""
        context = multiprocessing.get_context("spawn")
        self._stop = context.Event()
        self._results = context.Queue()
        process = context.Process(target=_monitor_process, args=(self, self._stop, self._results))
        process.start()
        return process

    def stop(self, process) -> None:
        self._stop.set()
        figures = self._results.get(timeout=60)
        process.join(timeout=30)
        self.__dict__.update(figures)

    async def run(self) -> None:
        address = f"127.0.0.1:{self.grpc_port}"
        async with grpc.aio.insecure_channel(address) as channel:
            reader, writer = await asyncio.open_connection("127.0.0.1", self.rest_port)
            health = health_pb2_grpc.HealthStub(channel)
            tick = 0
            while not self._stop.is_set():
                if writer.is_closing() or reader.at_eof():
                    self.failures.append("the monitor's REST connection was closed")
                    reader, writer = await asyncio.open_connection("127.0.0.1", self.rest_port)
                await self._probe(health, reader, writer)
                if tick % 10 == 0:
                    await self._fresh_connection(address)
                self.peak_rss_mib = max(self.peak_rss_mib, rss_mib(self.pid))
                tick += 1
                await asyncio.sleep(0.1)

    async def _probe(self, health, reader, writer) -> None:
        start = time.monotonic()
        try:
            await health.Check(health_pb2.HealthCheckRequest(), timeout=2)
            writer.write(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 2)
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
        except (grpc.aio.AioRpcError, OSError, EOFError, asyncio.TimeoutError, IndexError) as error:
            self.failures.append(f"health probe: {error!r}"[:200])
            return
        self.latencies_s.append(time.monotonic() - start)

    async def _fresh_connection(self, address: str) -> None:
        options = (("grpc.use_local_subchannel_pool", 1),)
        try:
            async with grpc.aio.insecure_channel(address, options=options) as fresh:
                await health_pb2_grpc.HealthStub(fresh).Check(
                    health_pb2.HealthCheckRequest(), timeout=3
                )
            self.num_fresh_connections += 1
        except grpc.aio.AioRpcError:
            self.num_fresh_refused += 1


def _monitor_process(monitor: Monitor, stop, results) -> None:
    monitor.reset()
    monitor._stop = stop
    asyncio.run(monitor.run())
    figures = (
        "latencies_s", "failures", "num_fresh_connections", "num_fresh_refused", "peak_rss_mib"
    )  # fmt: skip
    results.put({name: getattr(monitor, name) for name in figures})


@dataclass
class Outcome:
    name: str
    verdict: str  # held / degraded / failed
    figure: str
    floods_grpc_port: bool = False  # new gRPC connections may be refused: the cap is full


async def _open_idle(port: int, count: int) -> list[tuple]:
    connections = []
    for _ in range(count):
        with contextlib.suppress(OSError):
            connections.append(await asyncio.open_connection("127.0.0.1", port))
    return connections


async def _num_open(connections, seconds: float) -> int:
    """How many of ``connections`` the server has not closed within ``seconds``."""

    async def closed(reader) -> bool:
        try:
            while await reader.read(4096):
                pass
        except OSError:
            pass
        return True

    done = await asyncio.gather(
        *(asyncio.wait_for(closed(r), seconds) for r, _ in connections), return_exceptions=True
    )
    return sum(1 for result in done if result is not True)


def _close_all(connections) -> None:
    for _, writer in connections:
        writer.close()


async def idle_rest_sockets(ctx: Context) -> Outcome:
    """More idle REST connections than the process has file descriptors for."""
    connections = await _open_idle(ctx.rest_port, ctx.fd_limit)
    refused = await _num_open(connections, 1.0)
    num_refused = len(connections) - refused
    still_open = await _num_open(connections, ctx.header_timeout_s + 3)
    _close_all(connections)
    figure = (
        f"{len(connections)} opened, {num_refused} closed at accept, {still_open} still open "
        f"{ctx.header_timeout_s + 4:g} s later"
    )
    return Outcome("idle-rest-sockets", "degraded" if not still_open else "failed", figure)


async def slowloris_rest(ctx: Context) -> Outcome:
    """Request heads trickled a byte a second."""
    connections = await _open_idle(ctx.rest_port, 300)
    head = b"GET /v1/models HTTP/1.1\r\nhost: x\r\nx-pad: " + b"a" * 1000
    start = time.monotonic()
    for index in range(int(ctx.header_timeout_s) + 3):
        for _, writer in connections:
            if not writer.is_closing():
                with contextlib.suppress(OSError):
                    writer.write(head[index : index + 1])
        await asyncio.sleep(1.0)
    still_open = await _num_open(connections, 1.0)
    _close_all(connections)
    figure = f"300 trickling heads, {still_open} open after {time.monotonic() - start:.0f} s"
    return Outcome("slowloris-rest", "held" if not still_open else "failed", figure)


async def _silent_calls(port: int, key: str, per_connection: int, connections: int):
    """Calls that send their headers and never their message; the codes they ended with."""
    stop = asyncio.Event()

    async def never():
        await stop.wait()
        if False:
            yield

    options = (("grpc.use_local_subchannel_pool", 1),)
    channels = [
        grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) for _ in range(connections)
    ]
    calls = [
        channel.stream_stream(GENERATE)(never(), metadata=(("authorization", f"Bearer {key}"),))
        for channel in channels
        for _ in range(per_connection)
    ]

    async def code(call) -> str:
        try:
            async for _ in call:
                pass
        except grpc.aio.AioRpcError as error:
            return error.code().name
        return "OK"

    return stop, channels, [asyncio.ensure_future(code(call)) for call in calls]


def _ended_by_the_server(name: str, codes: list, done: set, expected: str) -> Outcome:
    """Held if the server ended every call: with ``expected``, or CANCELLED, which a client
    that never half-closes sees when the server's end of stream outruns its status."""
    counts = collections.Counter(task.result() for task in done)
    ended = counts[expected] + counts["CANCELLED"]
    figure = f"{len(codes)} calls: {dict(counts)}, {len(codes) - len(done)} still open"
    return Outcome(name, "held" if ended == len(codes) else "failed", figure)


async def _silent_streams(ctx: Context, key: str, per_connection: int, timeout: float):
    """6 connections' worth of calls sending their headers and never their message."""
    stop, channels, codes = await _silent_calls(ctx.grpc_port, key, per_connection, 6)
    done, pending = await asyncio.wait(codes, timeout=timeout)
    stop.set()
    for task in pending:
        task.cancel()
    for channel in channels:
        await channel.close()
    return codes, done


async def idle_streams_wrong_key(ctx: Context) -> Outcome:
    """Many HTTP/2 streams with a wrong key, none sending its message."""
    codes, done = await _silent_streams(ctx, "wrong", 1000, timeout=120)
    return _ended_by_the_server("idle-streams-wrong-key", codes, done, "UNAUTHENTICATED")


async def idle_streams_valid_key(ctx: Context) -> Outcome:
    """A connection's worth of streams with the right key, none sending its message."""
    codes, done = await _silent_streams(ctx, KEY, 256, timeout=ctx.message_timeout_s + 20)
    return _ended_by_the_server("idle-streams-valid-key", codes, done, "DEADLINE_EXCEEDED")


async def idle_grpc_sockets(ctx: Context) -> Outcome:
    """More raw TCP connections to the gRPC port than its cap, none sending the preface."""
    connections = await _open_idle(ctx.grpc_port, ctx.fd_limit // 2)
    still_open = await _num_open(connections, 10 + 4)  # --grpc-handshake-timeout's default
    _close_all(connections)
    figure = f"{len(connections)} opened, {still_open} still open 14 s later"
    verdict = "degraded" if not still_open else "failed"
    return Outcome("idle-grpc-sockets", verdict, figure, floods_grpc_port=True)


def _request_attack(attack):
    """One of ``attack_requests``' attacks, as an attack of this harness."""
    name = attack.__name__.replace("_", "-")

    async def run(ctx: Context) -> Outcome:
        return Outcome(name, *await attack(ctx))

    return run


ATTACKS = {
    attack.__name__.replace("_", "-"): attack
    for attack in (
        idle_rest_sockets,
        slowloris_rest,
        idle_grpc_sockets,
        idle_streams_wrong_key,
        idle_streams_valid_key,
    )
}
ATTACKS.update(
    {attack.__name__.replace("_", "-"): _request_attack(attack) for attack in request_attacks}
)


@dataclass
class Context:
    grpc_port: int
    rest_port: int
    pid: int
    fd_limit: int
    header_timeout_s: float
    message_timeout_s: float
    monitor: Monitor
    log_path: Path
    model_name: str = MODEL_NAME
    stall_timeout_s: float = STALL_TIMEOUT_S


def _judge(
    outcome: Outcome, monitor: Monitor, rss_before: float, log_growth: int, alive: bool
) -> Outcome:
    problems = list(monitor.failures[:3])
    if monitor.num_fresh_refused and not outcome.floods_grpc_port:
        problems.append(f"{monitor.num_fresh_refused} fresh gRPC connections failed")
    rss_growth = monitor.peak_rss_mib - rss_before
    if rss_growth > RSS_BOUND_MIB:
        problems.append(f"RSS grew {rss_growth:.0f} MiB")
    worst = max(monitor.latencies_s, default=0.0)
    if worst > HEALTH_BOUND_S:
        problems.append(f"health took {worst * 1000:.0f} ms")
    if log_growth > LOG_BOUND_BYTES:
        problems.append(f"the log grew {log_growth / 1024:.0f} KiB")
    if not alive:
        problems.append("the server died")
    p50 = statistics.median(monitor.latencies_s) * 1000 if monitor.latencies_s else 0.0
    figure = (
        f"{outcome.figure}; health p50 {p50:.1f} ms, max {worst * 1000:.1f} ms over "
        f"{len(monitor.latencies_s)} probes, {monitor.num_fresh_connections} fresh gRPC "
        f"connections ({monitor.num_fresh_refused} refused), RSS {rss_growth:+.0f} MiB at "
        f"its peak, log +{log_growth / 1024:.0f} KiB"
    )
    if problems:
        return Outcome(outcome.name, "failed", f"{figure}; {'; '.join(problems)}")
    return Outcome(outcome.name, outcome.verdict, figure)


def _start_server(args, model: list[str], grpc_port: int, rest_port: int, log) -> subprocess.Popen:
    def limit_files() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (args.fd_limit, args.fd_limit))

    command = [
        str(Path(sys.executable).with_name("llmrpc")), "serve", *model,
        "--grpc-port", str(grpc_port), "--port", str(rest_port), "--host", "127.0.0.1",
        "--api-key", KEY, OTHER_KEY, "--served-model-name", MODEL_NAME,
        "--max-model-len", str(MAX_MODEL_LEN), "--max-num-batched-tokens", "256",
        "--engine-stall-timeout", str(STALL_TIMEOUT_S),
        "--disable-log-stats",
        "--disable-uvicorn-access-log",
        "--request-header-timeout", str(args.header_timeout),
        "--grpc-request-message-timeout", str(args.message_timeout),
    ]  # fmt: skip
    return subprocess.Popen(command, stdout=log, stderr=log, preexec_fn=limit_files)


def _tiny_model(out_dir: Path) -> list[str]:
    """A 2-layer random-weight Llama with the packaged model's tokenizer and a long context."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: tiny_models
    from tiny_models import TINY_DECODER, save_tiny_model

    from llmrpc.engine.loading.loader import resolve_model_dir

    config = {**TINY_DECODER, "tie_word_embeddings": True, "max_position_embeddings": MAX_MODEL_LEN}
    return [str(save_tiny_model(out_dir, resolve_model_dir(None), "llama", **config))]


async def attack(args) -> int:
    model = args.model or _tiny_model(Path(tempfile.mkdtemp(prefix="llmrpc-attack-")))
    grpc_port, rest_port = free_port(), free_port()
    log_path = Path(tempfile.mkdtemp(prefix="llmrpc-attack-log-")) / "server.log"
    with open(log_path, "wb") as log:
        server = _start_server(args, model, grpc_port, rest_port, log)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            await wait_serving(channel, server)
        monitor = Monitor(grpc_port, rest_port, server.pid)
        ctx = Context(
            grpc_port, rest_port, server.pid, args.fd_limit, args.header_timeout,
            args.message_timeout, monitor, log_path,
        )  # fmt: skip
        outcomes = [await _run_one(name, ctx, server) for name in args.only or ATTACKS]
    finally:
        server.terminate()
        server.wait(timeout=60)
    for outcome in outcomes:
        print(f"{outcome.verdict:9} {outcome.name:24} {outcome.figure}")
    print(f"server log: {log_path}")
    return 1 if any(outcome.verdict == "failed" for outcome in outcomes) else 0


async def _run_one(name: str, ctx: Context, server: subprocess.Popen) -> Outcome:
    log_before, rss_before = ctx.log_path.stat().st_size, rss_mib(ctx.pid)
    watching = ctx.monitor.start()
    await asyncio.sleep(0.5)  # the monitor's connections are open before the attack starts
    try:
        outcome = await ATTACKS[name](ctx)
    finally:
        await asyncio.sleep(1.0)
        ctx.monitor.stop(watching)
    growth = ctx.log_path.stat().st_size - log_before
    return _judge(outcome, ctx.monitor, rss_before, growth, server.poll() is None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="*", help="Model to serve (default: a tiny one).")
    parser.add_argument("--only", nargs="+", choices=sorted(ATTACKS), help="Attacks to run.")
    parser.add_argument("--fd-limit", type=int, default=4096, help="The server's open files.")
    parser.add_argument("--header-timeout", type=float, default=10.0)
    parser.add_argument("--message-timeout", type=float, default=5.0)
    args = parser.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # the attacker's own sockets
    if hard < 2 * args.fd_limit:
        raise SystemExit(
            f"this process may open {hard} files; the attacks need {2 * args.fd_limit}"
        )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(asyncio.run(attack(args)))


if __name__ == "__main__":
    main()
