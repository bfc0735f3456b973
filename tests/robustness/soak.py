"""``make soak``: a bounded soak of a real ``llmrpc serve`` on loopback, attacked as clients do.

Many requests at high concurrency over gRPC (unary and streamed) and REST (completions and chat,
SSE and not), some cancelled at a random moment (before the first token too), some malformed,
some with tight deadlines, random priorities under ``--scheduling-policy priority``, and a KV
cache small enough to force preemption. At the end, a SIGTERM while streams are in flight: they
must finish and the process must exit 0.

Every request is classed: finished (a finish reason arrived), a typed error (the status or HTTP
code its kind of request earns: INVALID_ARGUMENT/400 for a malformed one, DEADLINE_EXCEEDED for
a tight deadline, RESOURCE_EXHAUSTED/429 under load, CANCELLED for our own hang-ups), or lost
(anything else: INTERNAL, UNKNOWN, UNAVAILABLE, a 5xx, a broken stream, a bad request that was
served). The tool prints a table and exits 1 on any lost request, leaked KV block, server death,
non-zero exit, or an idle RSS more than 10% above its post-warm-up figure.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmrpc.v1 import admin_pb2, admin_pb2_grpc, common_pb2, generation_pb2, generation_pb2_grpc

WORDS = (
    "the", "a", "river", "mountain", "quick", "brown", "fox", "jumps", "over", "lazy", "dog",
    "story", "city", "night",
)  # fmt: skip
MALFORMED = (  # (gRPC fields, REST fields): each refused with INVALID_ARGUMENT / 400
    ({"sampling": {"temperature": -1.0}}, {"temperature": -1}),
    ({"sampling": {"top_p": 2.0}}, {"top_p": 2}),
    ({"sampling": {"temperature": float("nan")}}, {"max_tokens": 10**10}),
    ({"stopping": {"max_tokens": 10**6}}, {"max_tokens": 10**6}),
    ({"token_ids": {"ids": [10**8]}}, {"presence_penalty": 5}),
)
EXPECTED_GRPC = {
    "ok": {grpc.StatusCode.RESOURCE_EXHAUSTED},
    "malformed": {grpc.StatusCode.INVALID_ARGUMENT},
    "deadline": {grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED},
    "cancel": {grpc.StatusCode.CANCELLED, grpc.StatusCode.RESOURCE_EXHAUSTED},
}
EXPECTED_HTTP = {"ok": {429}, "malformed": {400}, "deadline": {429}, "cancel": {429}}


@dataclass
class Tally:
    outcomes: collections.Counter = field(default_factory=collections.Counter)
    lost: list[str] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    rss_mib: list[float] = field(default_factory=list)

    def record(self, outcome: str, detail: str = "") -> None:
        self.outcomes[outcome] += 1
        if outcome == "lost":
            self.lost.append(detail)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 120)))


def pick_kind(rng: random.Random) -> str:
    roll = rng.random()
    return (
        "cancel"
        if roll < 0.10
        else "malformed"
        if roll < 0.15
        else ("deadline" if roll < 0.20 else "ok")
    )


# --- gRPC ----------------------------------------------------------------------------------


def grpc_request(rng: random.Random, kind: str) -> generation_pb2.GenerateRequest:
    request = generation_pb2.GenerateRequest(
        text=prompt(rng),
        sampling=common_pb2.SamplingParams(temperature=rng.choice((0.0, 0.7, 1.0))),
        stopping=common_pb2.StoppingCriteria(max_tokens=rng.randint(1, 48)),
        priority=rng.randint(0, 3),
    )
    if kind == "malformed":
        fields, _ = rng.choice(MALFORMED)
        for name, values in fields.items():
            if name == "token_ids":
                request.token_ids.ids.extend(values["ids"])
            else:
                for key, value in values.items():
                    setattr(getattr(request, name), key, value)
    return request


async def grpc_call(stub, rng: random.Random, kind: str, tally: Tally) -> None:
    request = grpc_request(rng, kind)
    timeout = rng.uniform(0.01, 0.08) if kind == "deadline" else 120
    stream = rng.random() < 0.6
    try:
        if stream:
            call = stub.GenerateStream(request, timeout=timeout)
            cut_after = rng.randrange(4) if kind == "cancel" else None
            if cut_after == 0:
                call.cancel()
            messages = []
            async for message in call:
                messages.append(message)
                if cut_after is not None and len(messages) >= cut_after:
                    call.cancel()
                    break
            finished = bool(messages) and messages[-1].finish_reason != 0
        else:
            task = asyncio.ensure_future(stub.Generate(request, timeout=timeout))
            if kind == "cancel":
                await asyncio.sleep(rng.uniform(0, 0.2))
                task.cancel()
            finished = (await task).finish_reason != 0
    except asyncio.CancelledError:
        return tally.record("typed error" if kind == "cancel" else "lost", "cancelled")
    except grpc.aio.AioRpcError as error:
        if error.code() in EXPECTED_GRPC[kind]:
            return tally.record("typed error")
        return tally.record("lost", f"gRPC {kind}: {error.code().name} {error.details()}")
    if kind == "cancel" and not finished:
        return tally.record("typed error")
    if kind == "malformed":
        return tally.record("lost", "gRPC: a malformed request was served")
    tally.record("finished" if finished else "lost", "gRPC: no finish reason")


# --- REST ----------------------------------------------------------------------------------


def rest_body(rng: random.Random, kind: str) -> tuple[str, dict]:
    chat = rng.random() < 0.5
    body = {"model": "", "max_tokens": rng.randint(1, 48), "temperature": rng.choice((0, 0.7))}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt(rng)}]
    else:
        body["prompt"] = prompt(rng)
    if kind == "malformed":
        body.update(rng.choice(MALFORMED)[1])
    body.pop("model")
    body["stream"] = rng.random() < 0.6
    return ("/v1/chat/completions" if chat else "/v1/completions"), body


async def rest_call(session, base: str, rng: random.Random, kind: str, tally: Tally) -> None:
    path, body = rest_body(rng, kind)
    limit = rng.uniform(0.01, 0.08) if kind == "deadline" else rng.uniform(0, 0.3)
    try:
        await asyncio.wait_for(
            _rest_exchange(session, base + path, body, kind, tally),
            limit if kind in ("cancel", "deadline") else 120,
        )
    except (TimeoutError, asyncio.TimeoutError):  # we hung up (or a real timeout)
        if kind in ("cancel", "deadline"):
            return tally.record("typed error")
        return tally.record("lost", "REST: timed out")
    except aiohttp.ClientError as error:
        return tally.record("lost", f"REST: {error!r}")


async def _rest_exchange(session, url: str, body: dict, kind: str, tally: Tally) -> None:
    async with session.post(url, json=body) as reply:
        if reply.status != 200:
            text = await reply.text()
            if reply.status in EXPECTED_HTTP[kind]:
                return tally.record("typed error")
            return tally.record("lost", f"REST {kind}: {reply.status} {text[:200]}")
        finished = await _rest_finished(reply, body["stream"])
    if kind == "malformed":
        return tally.record("lost", "REST: a malformed request was served")
    tally.record("finished" if finished else "lost", "REST: no finish reason")


async def _rest_finished(reply, stream: bool) -> bool:
    if not stream:
        return (await reply.json())["choices"][0]["finish_reason"] is not None
    finished = done = False
    async for line in reply.content:
        text = line.decode().strip()
        if text == "data: [DONE]":
            done = True
        elif text.startswith("data: "):
            event = json.loads(text[6:])
            if "error" in event:
                return False
            finished |= any(c.get("finish_reason") for c in event.get("choices", ()))
    return finished and done


# --- the run -------------------------------------------------------------------------------


def tiny_model(out_dir: Path) -> list[str]:
    """A 2-layer random-weight Llama with the packaged model's real tokenizer: the serving stack
    is what a soak stresses, and this model lets it pass 10,000 requests in minutes."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: tiny_models
    from tiny_models import TINY_DECODER, save_tiny_model

    from llmrpc.engine.loading.loader import resolve_model_dir

    config = {**TINY_DECODER, "tie_word_embeddings": True}
    return [str(save_tiny_model(out_dir, resolve_model_dir(None), "llama", **config))]


def start_server(args, grpc_port: int, rest_port: int) -> subprocess.Popen:
    command = [
        str(Path(sys.executable).with_name("llmrpc")), "serve", *args.model,
        "--grpc-port", str(grpc_port), "--port", str(rest_port), "--host", "127.0.0.1",
        "--scheduling-policy", "priority", "--num-gpu-blocks-override", str(args.kv_blocks),
        "--max-model-len", "512", "--max-waiting-requests", str(args.max_waiting),
        "--shutdown-grace", "30", "--disable-log-stats", "--dtype", args.dtype,
        *args.server_args,
    ]  # fmt: skip
    return subprocess.Popen(command, stdout=sys.stderr, stderr=sys.stderr)


async def wait_serving(channel, server: subprocess.Popen, timeout: float = 600) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"the server exited with {server.returncode} while starting")
        try:
            reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=2)
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.aio.AioRpcError:
            pass
        await asyncio.sleep(0.5)
    raise SystemExit("the server did not report SERVING in time")


async def drive(args, stub, base: str, tally: Tally, server: subprocess.Popen) -> None:
    rng = random.Random(args.seed)
    seeds = iter(range(args.requests))
    async with aiohttp.ClientSession() as session:

        async def worker() -> None:
            for index in seeds:
                local = random.Random(rng.random() + index)
                kind = pick_kind(local)
                started = time.monotonic()
                if local.random() < args.rest_share:
                    await rest_call(session, base, local, kind, tally)
                else:
                    await grpc_call(stub, local, kind, tally)
                tally.latencies.append(time.monotonic() - started)

        async def sample_rss() -> None:
            while True:
                tally.rss_mib.append(rss_mib(server.pid))
                await asyncio.sleep(1)

        sampler = asyncio.ensure_future(sample_rss())
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        sampler.cancel()


async def idle_figures(admin, blocks: int) -> tuple[int, int, int]:
    """(running, waiting, KV blocks in use) once the server settles (30 s at most)."""
    for _ in range(60):
        load = await admin.GetLoad(admin_pb2.GetLoadRequest())
        figures = (
            load.num_running_requests,
            load.num_waiting_requests,
            round(load.kv_cache_usage * blocks),
        )
        if figures == (0, 0, 0):
            break
        await asyncio.sleep(0.5)
    return figures


async def drain(stub, server: subprocess.Popen) -> tuple[int, int]:
    """SIGTERM with 8 streams in flight: (streams finished, exit status)."""
    request = generation_pb2.GenerateRequest(
        text="Drain me", stopping=common_pb2.StoppingCriteria(max_tokens=64, ignore_eos=True)
    )

    async def stream() -> bool:
        messages = [m async for m in stub.GenerateStream(request, timeout=120)]
        return bool(messages) and messages[-1].finish_reason == generation_pb2.FINISH_REASON_LENGTH

    streams = [asyncio.ensure_future(stream()) for _ in range(8)]
    await asyncio.sleep(0.5)
    server.send_signal(signal.SIGTERM)
    results = await asyncio.gather(*streams, return_exceptions=True)
    status = await asyncio.to_thread(server.wait, 60)
    return sum(r is True for r in results), status


def report(tally: Tally, facts: dict) -> list[str]:
    latencies = sorted(tally.latencies) or [0.0]
    p99 = latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))]
    peak = max(tally.rss_mib, default=0.0)
    rows = [
        ("requests sent", sum(tally.outcomes.values())),
        ("finished", tally.outcomes["finished"]),
        ("typed errors", tally.outcomes["typed error"]),
        ("lost", tally.outcomes["lost"]),
        ("leaked KV blocks", facts["leaked_blocks"]),
        ("left running / waiting", f"{facts['running']} / {facts['waiting']}"),
        ("RSS after warm-up / peak / idle end (MiB)",
         f"{facts['rss_start']:.0f} / {peak:.0f} / {facts['rss_end']:.0f}"),
        ("latency p50 / p99 (s)", f"{statistics.median(latencies):.3f} / {p99:.3f}"),
        ("drain: streams finished of 8, exit status", f"{facts['drained']}, {facts['exit']}"),
        ("wall time (s)", f"{facts['wall']:.0f}"),
    ]  # fmt: skip
    width = max(len(name) for name, _ in rows)
    print("\n".join(f"{name:<{width}}  {value}" for name, value in rows))
    failures = [f"lost: {detail}" for detail in tally.lost[:20]]
    if facts["leaked_blocks"] or facts["running"] or facts["waiting"]:
        failures.append("requests or KV blocks left behind")
    if facts["drained"] != 8 or facts["exit"] != 0:
        failures.append("the SIGTERM drain lost streams or the exit status was not 0")
    if facts["rss_end"] > 1.10 * facts["rss_start"]:
        failures.append("idle RSS more than 10% above its post-warm-up figure")
    return failures


async def soak(args) -> int:
    if args.tiny and not args.model:
        args.model = tiny_model(Path(tempfile.mkdtemp(prefix="llmrpc-soak-")))
    grpc_port, rest_port = free_port(), free_port()
    server = start_server(args, grpc_port, rest_port)
    tally, started = Tally(), time.monotonic()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            await wait_serving(channel, server)
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            admin = admin_pb2_grpc.AdminServiceStub(channel)
            await asyncio.sleep(2)
            rss_start = rss_mib(server.pid)
            await drive(args, stub, f"http://127.0.0.1:{rest_port}", tally, server)
            if server.poll() is not None:
                raise SystemExit(f"the server died during the soak (exit {server.returncode})")
            running, waiting, blocks = await idle_figures(admin, args.kv_blocks)
            await asyncio.sleep(args.idle_s)  # idle: memory should come back
            rss_end = rss_mib(server.pid)
            drained, status = await drain(stub, server)
    finally:
        if server.poll() is None:
            server.kill()
    facts = {
        "leaked_blocks": blocks, "running": running, "waiting": waiting,
        "rss_start": rss_start, "rss_end": rss_end, "drained": drained, "exit": status,
        "wall": time.monotonic() - started,
    }  # fmt: skip
    failures = report(tally, facts)
    for failure in failures:
        print(f"FAIL {failure}")
    return 1 if failures else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="*", help="Model to serve (default: the packaged one).")
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="With no model: a tiny random-weight one (real tokenizer).",
    )
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--rest-share", type=float, default=0.5, help="Share sent over REST.")
    parser.add_argument("--kv-blocks", type=int, default=320, help="Small: forces preemption.")
    parser.add_argument("--max-waiting", type=int, default=256)
    parser.add_argument("--idle-s", type=float, default=10.0, help="Idle time before RSS end.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--dtype",
        default="float32",
        help="The server's --dtype (default float32: on CPUs without bf16 units, such as AVX2-only "
        "ones, it computes several times faster than bfloat16).",
    )
    parser.add_argument(
        "--server-args", nargs=argparse.REMAINDER, default=[], help="More `llmrpc serve` flags."
    )
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(asyncio.run(soak(parser.parse_args())))


if __name__ == "__main__":
    main()
