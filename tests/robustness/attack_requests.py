"""The request-level attacks of ``make attack`` (``attack.py`` runs them and judges the server's
health, memory and log meanwhile). Each takes the attack context and returns ``(verdict,
figure)``: held when the server refused or bounded what the attack asked for, failed otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from pathlib import Path

import aiohttp
import grpc

KEY, OTHER_KEY = "attack-key", "attack-key-2"
MESSAGES = [{"role": "user", "content": "Say something."}]


def _headers(key: str = KEY) -> dict:
    return {"authorization": f"Bearer {key}"}


async def _post(session, ctx, path: str, body: dict, key: str = KEY) -> tuple[int, dict]:
    url = f"http://127.0.0.1:{ctx.rest_port}{path}"
    async with session.post(url, json=body, headers=_headers(key)) as reply:
        return reply.status, await reply.json(content_type=None)


async def responses_store(ctx) -> tuple[str, str]:
    """Tool descriptions the model never sees, echoed into stored responses."""
    tools = [
        {"type": "function", "name": f"t{i}", "description": "x" * 85_000, "parameters": {}}
        for i in range(128)
    ]
    huge = {
        "model": ctx.model_name, "input": "hi", "tools": tools, "tool_choice": "none",
        "max_output_tokens": 4,
    }  # fmt: skip
    legal_tools = [{**tool, "description": "x" * 16_000} for tool in tools[:60]]
    legal = {**huge, "tools": legal_tools}
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        status, reply = await _post(session, ctx, "/v1/responses", huge)
        param = (reply.get("error") or {}).get("param")
        replies = [await _post(session, ctx, "/v1/responses", legal) for _ in range(100)]
    served = sum(1 for status, _ in replies if status == 200)
    refusals = {json.dumps(reply)[:160] for status, reply in replies if status != 200}
    figure = (
        f"128 x 85 KB tools: {status} naming {param}; 100 x 60 x 16 KB tools: {served} served"
        + (f" ({refusals})" if refusals else "")
    )
    held = status == 400 and param == "tools[0].description" and served == 100
    return ("held" if held else "failed"), figure


async def responses_of_another_key(ctx) -> tuple[str, str]:
    """Reading, continuing and deleting a response stored under another key."""
    timeout = aiohttp.ClientTimeout(total=60)
    base = f"http://127.0.0.1:{ctx.rest_port}/v1/responses"
    async with aiohttp.ClientSession(timeout=timeout) as session:
        body = {"model": ctx.model_name, "input": "hi", "max_output_tokens": 4}
        _, stored = await _post(session, ctx, "/v1/responses", body)
        url = f"{base}/{stored['id']}"
        async with session.get(url, headers=_headers(OTHER_KEY)) as reply:
            read = reply.status
        follow = {**body, "previous_response_id": stored["id"]}
        continued, _ = await _post(session, ctx, "/v1/responses", follow, key=OTHER_KEY)
        async with session.delete(url, headers=_headers(OTHER_KEY)) as reply:
            deleted = reply.status
        async with session.get(url, headers=_headers()) as reply:
            kept = reply.status
    figure = f"other key: GET {read}, continue {continued}, DELETE {deleted}; owner's GET {kept}"
    held = read == 404 and continued in (400, 404) and deleted == 404 and kept == 200
    return ("held" if held else "failed"), figure


async def grammar_compiles(ctx) -> tuple[str, str]:
    """Four slow grammars compiling while another client asks for json_object."""
    timeout = aiohttp.ClientTimeout(total=300)
    # short to send and slow to compile (seconds each: the size of the grammar is no guide)
    slow = [{"type": "string", "maxLength": 3000 + i} for i in range(4)]
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def constrained(schema: dict, name: str) -> tuple[int, float]:
            fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}
            body = {"model": ctx.model_name, "messages": MESSAGES, "max_tokens": 4}
            start = time.monotonic()
            status, _ = await _post(
                session, ctx, "/v1/chat/completions", {**body, "response_format": fmt}
            )
            return status, time.monotonic() - start

        heavy = [asyncio.create_task(constrained(schema, f"s{i}")) for i, schema in enumerate(slow)]
        await asyncio.sleep(0.5)  # they are compiling
        cheap_status, cheap_s = await constrained({"type": "object"}, "cheap")
        heavy_done = sum(task.done() for task in heavy)
        results = await asyncio.gather(*heavy)
    slowest = max(seconds for _, seconds in results)
    figure = (
        f"json_object {cheap_status} in {cheap_s:.2f} s, {heavy_done} of 4 slow ones done by then; "
        f"those: {sorted({status for status, _ in results})} in up to {slowest:.1f} s"
    )
    held = cheap_status == 200 and cheap_s < slowest
    return ("held" if held else "failed"), figure


async def long_prefill(ctx) -> tuple[str, str]:
    """A short request arriving while a 12,000-token prompt is being prefilled (in chunks of
    --max-num-batched-tokens 256, so that the tiny model's prefill lasts many steps)."""
    timeout = aiohttp.ClientTimeout(total=300)
    long_prompt = " ".join(f"w{i % 97}" for i in range(4000))  # about 12,000 tokens
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def first_token_at(prompt: str) -> float:
            body = {"model": ctx.model_name, "prompt": prompt, "max_tokens": 2, "stream": True}
            url = f"http://127.0.0.1:{ctx.rest_port}/v1/completions"
            async with session.post(url, json=body, headers=_headers()) as reply:
                async for line in reply.content:
                    if line.startswith(b"data: {"):
                        return time.monotonic()
            return float("inf")

        long = asyncio.create_task(first_token_at(long_prompt))
        await asyncio.sleep(0.3)  # its prefill has begun
        short_at = await first_token_at("Hi there")
        long_at = await long
    figure = (
        f"the short request's first token came {long_at - short_at:.2f} s before the long one's"
    )
    return ("held" if short_at < long_at < float("inf") else "failed"), figure


async def schemas_and_bytes(ctx) -> tuple[str, str]:
    """Schemas that admit nothing or ask what xgrammar ignores; bytes that are no protobuf."""
    timeout = aiohttp.ClientTimeout(total=120)
    schemas = ({"$ref": "#"}, {"not": {}}, {"if": {"type": "integer"}, "then": {"minimum": 5}})
    async with aiohttp.ClientSession(timeout=timeout) as session:
        statuses = []
        for schema in schemas:
            fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
            body = {"model": ctx.model_name, "messages": MESSAGES, "response_format": fmt}
            statuses.append((await _post(session, ctx, "/v1/chat/completions", body))[0])
    async with grpc.aio.insecure_channel(f"127.0.0.1:{ctx.grpc_port}") as channel:
        generate = channel.unary_unary("/llmrpc.v1.GenerationService/Generate")
        codes = []
        for key in (KEY, "wrong"):
            try:
                await generate(b"\xff\xff\xff\xff", metadata=_grpc_key(key), timeout=10)
                codes.append("OK")
            except grpc.aio.AioRpcError as error:
                codes.append(error.code().name)
    figure = f"schemas: {statuses}; malformed protobuf with the key, without: {codes}"
    held = statuses == [400, 400, 400] and codes == ["INVALID_ARGUMENT", "UNAUTHENTICATED"]
    return ("held" if held else "failed"), figure


async def unknown_keys(ctx) -> tuple[str, str]:
    """A body of a million unknown keys, and one of a million logit_bias entries."""
    timeout = aiohttp.ClientTimeout(total=120)
    base = {"model": ctx.model_name, "prompt": "hi", "max_tokens": 2}
    bodies = (
        {**base, **{f"k{i}": 0 for i in range(1_000_000)}},
        {**base, "logit_bias": {str(i): 1 for i in range(1_000_000)}},
    )
    encoded = [json.dumps(body).encode() for body in bodies]  # the attacker's CPU, up front
    del bodies
    await asyncio.sleep(1.0)
    outcomes = []
    url = f"http://127.0.0.1:{ctx.rest_port}/v1/completions"
    headers = {**_headers(), "content-type": "application/json"}
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for data in encoded:
            start = time.monotonic()
            async with session.post(url, data=data, headers=headers) as reply:
                await reply.read()
                outcomes.append((reply.status, time.monotonic() - start))
    figure = ", ".join(f"{status} in {seconds:.1f} s" for status, seconds in outcomes)
    held = all(status == 400 for status, _ in outcomes)
    return ("held" if held else "failed"), f"million keys, million logit_bias: {figure}"


async def fan_out(ctx) -> tuple[str, str]:
    """10,000 prompts in one request, 1,000 prompts x n=128, and a small caller beside a big
    batch of another key."""
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        many = {"model": ctx.model_name, "prompt": ["hi"] * 10_000, "max_tokens": 2}
        wide = {**many, "prompt": ["hi"] * 1000, "n": 128}
        refused = [(await _post(session, ctx, "/v1/completions", body))[0] for body in (many, wide)]
        big = {"model": ctx.model_name, "prompt": ["tell me a story"] * 200, "max_tokens": 64}
        batch = asyncio.create_task(_post(session, ctx, "/v1/completions", big))
        await asyncio.sleep(1.0)  # its sequences fill the batch and the queue
        small = {"model": ctx.model_name, "prompt": "hi", "max_tokens": 4}
        start = time.monotonic()
        small_status, _ = await _post(session, ctx, "/v1/completions", small, key=OTHER_KEY)
        small_s = time.monotonic() - start
        batch_running = not batch.done()
        batch_status, _ = await batch
    figure = (
        f"10,000 prompts: {refused[0]}, 1,000 x n=128: {refused[1]}; another key's request "
        f"{small_status} in {small_s:.1f} s, the 200-prompt batch still running: "
        f"{batch_running} (then {batch_status})"
    )
    held = refused == [400, 400] and small_status == 200 and batch_running
    return ("held" if held else "failed"), figure


async def frozen_engine(ctx) -> tuple[str, str]:
    """The engine process stopped (SIGSTOP) while a stream is in flight, then resumed."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    engine_pid = max(_children(ctx.pid), key=_rss_kib)
    timeout = aiohttp.ClientTimeout(total=300)
    body = {"model": ctx.model_name, "prompt": "Once", "max_tokens": 300, "stream": True}
    body["ignore_eos"] = True
    async with (
        aiohttp.ClientSession(timeout=timeout) as session,
        grpc.aio.insecure_channel(f"127.0.0.1:{ctx.grpc_port}") as channel,
    ):
        health = health_pb2_grpc.HealthStub(channel)

        async def until(status: int, within: float) -> float | None:
            start = time.monotonic()
            while time.monotonic() - start < within:
                reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=2)
                if reply.status == status:
                    return time.monotonic() - start
                await asyncio.sleep(0.1)
            return None

        url = f"http://127.0.0.1:{ctx.rest_port}/v1/completions"
        async with session.post(url, json=body, headers=_headers()) as reply:
            lines = reply.content.__aiter__()
            while not (await lines.__anext__()).startswith(b"data: {"):
                pass
            os.kill(engine_pid, signal.SIGSTOP)
            try:
                stalled_after = await until(health_pb2.HealthCheckResponse.NOT_SERVING, 30)
            finally:
                os.kill(engine_pid, signal.SIGCONT)
            back_after = await until(health_pb2.HealthCheckResponse.SERVING, 30)
            rest = [line async for line in lines]
    finished = b"data: [DONE]\n" in rest
    figure = (
        f"NOT_SERVING {_seconds(stalled_after)} after SIGSTOP (--engine-stall-timeout "
        f"{ctx.stall_timeout_s:g}), SERVING {_seconds(back_after)} after SIGCONT, the stream "
        f"{'finished' if finished else 'did not finish'}"
    )
    held = stalled_after is not None and back_after is not None and finished
    return ("held" if held else "failed"), figure


def _seconds(value: float | None) -> str:
    return "never" if value is None else f"{value:.1f} s"


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[1]) == pid:
                    found.append(int(entry.name))
    return found


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def _grpc_key(key: str) -> tuple:
    return (("authorization", f"Bearer {key}"),)


ATTACKS = (
    responses_store,
    responses_of_another_key,
    grammar_compiles,
    long_prefill,
    schemas_and_bytes,
    unknown_keys,
    fan_out,
    frozen_engine,
)
