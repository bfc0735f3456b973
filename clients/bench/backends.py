"""The two ways ``llmrpc bench serve`` sends a request and times it.

``grpc``: ``GenerationService.GenerateStream`` through ``AsyncClient``. ``openai``: streamed
``POST /v1/completions`` (server-sent events) over aiohttp, which any OpenAI-compatible server
accepts, vLLM's included; ``ignore_eos`` is vLLM's extension of that API, and token-id prompts
use the API's list-of-integers form of ``prompt``. The OpenAI API does not publish the
vocabulary size that random token-id prompts draw from: the openai backend asks
``GET /get_tokenizer_info`` (vLLM's, which llmrpc's gateway serves with
--enable-tokenizer-info-endpoint and fills with ``vocab_size``), then reads the ``config.json`` of
a model folder on this machine that ``GET /v1/models`` names (vLLM gives its --model path as the
model's ``root``).

Timing is taken when a response carrying new tokens arrives: time to first token (TTFT) is
from sending to the first one, inter-token latencies (ITL) are the gaps between later ones. A
message that carries several tokens (a server merging deltas for a slow reader) counts as one
gap, as in vLLM's benchmark.

A server that speculates tells its counters (GetLoad's ``spec_decode``, or ``/metrics``'
``vllm:spec_decode_*``): read before and after a run, they give the run's acceptance.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from llmrpc.clients.async_client import AsyncClient
from llmrpc.clients.bench.datasets import BenchRequest
from llmrpc.clients.errors import LlmrpcError
from llmrpc.clients.types import SpecDecode


@dataclass
class RequestResult:
    """What one benchmark request measured; times in seconds."""

    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_len: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0


class _Timer:
    def __init__(self, result: RequestResult) -> None:
        self.result = result
        self.start = self.last = time.perf_counter()
        self.seen_token = False

    def tokens_arrived(self) -> None:
        now = time.perf_counter()
        if self.seen_token:
            self.result.itl.append(now - self.last)
        else:
            self.result.ttft = now - self.start
            self.seen_token = True
        self.last = now

    def finish(self) -> RequestResult:
        self.result.latency = time.perf_counter() - self.start
        self.result.success = self.seen_token
        if not self.seen_token:
            self.result.error = "the server returned no tokens"
        return self.result


class GrpcBackend:
    name = "grpc"

    def __init__(self, client: AsyncClient, ignore_eos: bool, temperature: float) -> None:
        self.client = client
        self.params = {"ignore_eos": ignore_eos, "temperature": temperature}

    async def model_name(self) -> str:
        return (await self.client.model_info()).model

    async def vocab_size(self) -> int:
        return (await self.client.model_info()).vocab_size

    async def send(self, request: BenchRequest) -> RequestResult:
        result = RequestResult(prompt_len=request.prompt_len or 0)
        timer = _Timer(result)
        try:
            stream = self.client.stream(
                request.prompt, max_tokens=request.output_len, **self.params
            )
            async for delta in stream:
                if delta.token_ids:
                    timer.tokens_arrived()
                if delta.usage is not None:
                    result.prompt_len = delta.usage.prompt_tokens
                    result.output_len = delta.usage.completion_tokens
        except LlmrpcError as error:
            result.error = str(error)
            return result
        return timer.finish()

    async def spec_counts(self) -> SpecDecode | None:
        """The server's speculative decoding counters (GetLoad); None where it does not
        speculate."""
        return (await self.client.load()).spec_decode

    async def close(self) -> None:
        await self.client.close()


class OpenAIBackend:
    name = "openai"

    def __init__(
        self,
        http: aiohttp.ClientSession,
        base_url: str,
        model: str,
        vocab_size: int | None,
        ignore_eos: bool,
        temperature: float,
    ) -> None:
        self.http = http
        self.base_url = base_url  # ends in /v1
        self.model = model
        self._vocab_size = vocab_size
        self.extra = {"ignore_eos": ignore_eos, "temperature": temperature}

    async def vocab_size(self) -> int:
        """The vocabulary size for random prompts: as given, else what the server tells (see
        the module's doc); ValueError naming the flags when neither gives it."""
        if self._vocab_size is None:
            self._vocab_size = (
                await self._tokenizer_info_vocab_size() or await self._model_folder_vocab_size()
            )
        if self._vocab_size is None:
            raise ValueError(
                f"{self.server_url} does not publish its vocabulary size (no vocab_size from "
                "GET /get_tokenizer_info, no model folder here named by GET /v1/models), which "
                "random prompts need: pass --vocab-size N or --tokenizer MODEL_DIR"
            )
        return self._vocab_size

    @property
    def server_url(self) -> str:
        return self.base_url.removesuffix("/v1")

    async def _tokenizer_info_vocab_size(self) -> int | None:
        info = await self._get_json(f"{self.server_url}/get_tokenizer_info")
        size = info.get("vocab_size") if isinstance(info, dict) else None
        return size if isinstance(size, int) and size > 0 else None

    async def _model_folder_vocab_size(self) -> int | None:
        listing = await self._get_json(f"{self.base_url}/models")
        cards = listing.get("data") if isinstance(listing, dict) else None
        for card in cards if isinstance(cards, list) else ():
            if isinstance(card, dict) and card.get("id") == self.model:
                return vocab_size_of_folder(card.get("root")) or vocab_size_of_folder(card["id"])
        return None

    async def spec_counts(self) -> SpecDecode | None:
        """The server's ``vllm:spec_decode_*`` counters from its ``/metrics`` (vLLM's and our
        gateway's); None where it exposes none."""
        async with self.http.get(f"{self.server_url}/metrics") as response:
            if response.status != 200:
                return None
            return spec_counts_of_metrics(await response.text())

    async def _get_json(self, url: str):
        """The JSON a GET answers, or None for an error status or a body that is not JSON."""
        async with self.http.get(url) as response:
            if response.status != 200:
                return None
            try:
                return await response.json(content_type=None)
            except ValueError:
                return None

    async def model_name(self) -> str:
        """The model to ask for: the one given, else the first the server lists."""
        if self.model:
            return self.model
        async with self.http.get(f"{self.base_url}/models", raise_for_status=True) as response:
            self.model = (await response.json())["data"][0]["id"]
        return self.model

    def _body(self, request: BenchRequest) -> dict:
        return {
            "model": self.model,
            "prompt": request.prompt,
            "max_tokens": request.output_len,
            "stream": True,
            "stream_options": {"include_usage": True},
            **self.extra,
        }

    async def send(self, request: BenchRequest) -> RequestResult:
        result = RequestResult(prompt_len=request.prompt_len or 0)
        timer = _Timer(result)
        num_chunks = 0
        try:
            url = f"{self.base_url}/completions"
            async with self.http.post(url, json=self._body(request)) as reply:
                if reply.status != 200:
                    body = (await reply.read()).decode(errors="replace")
                    result.error = f"HTTP {reply.status}: {body[:200]}"
                    return result
                async for chunk in _events(reply):
                    if any(choice.get("text") for choice in chunk.get("choices") or ()):
                        timer.tokens_arrived()
                        num_chunks += 1
                    if usage := chunk.get("usage"):
                        result.prompt_len = usage.get("prompt_tokens", result.prompt_len)
                        result.output_len = usage.get("completion_tokens", 0)
        except (aiohttp.ClientError, TimeoutError, ValueError) as error:  # lost, malformed
            result.error = f"{type(error).__name__}: {error}"
            return result
        # A server that sends no usage: one token per text chunk is the best estimate.
        result.output_len = result.output_len or num_chunks
        return timer.finish()

    async def close(self) -> None:
        await self.http.close()


async def _events(reply: aiohttp.ClientResponse):
    """The JSON payloads of an SSE stream, until ``data: [DONE]`` or its end."""
    async for line in reply.content:
        if not line.startswith(b"data:"):
            continue  # blank separators, comments, event names
        payload = line[5:].strip()
        if payload == b"[DONE]":
            return
        yield json.loads(payload)


def spec_counts_of_metrics(text: str) -> SpecDecode | None:
    """``vllm:spec_decode_*`` counters in a Prometheus exposition, summed over their labels
    (models, engines); None without them."""
    totals: dict[str, float] = {}
    per_position: dict[int, float] = {}
    prefix = "vllm:spec_decode_"
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not (sample.name.startswith(prefix) and sample.name.endswith("_total")):
                continue
            name = sample.name[len(prefix) : -len("_total")]
            if name == "num_accepted_tokens_per_pos":
                position = int(sample.labels.get("position", 0))
                per_position[position] = per_position.get(position, 0.0) + sample.value
            else:
                totals[name] = totals.get(name, 0.0) + sample.value
    if "num_drafts" not in totals:
        return None
    positions = range(max(per_position, default=-1) + 1)
    return SpecDecode(
        int(totals["num_drafts"]),
        int(totals.get("num_draft_tokens", 0)),
        int(totals.get("num_accepted_tokens", 0)),
        tuple(int(per_position.get(p, 0)) for p in positions),
    )


def vocab_size_of_folder(folder) -> int | None:
    """``vocab_size`` from the ``config.json`` of a model folder on this machine, if any."""
    config = Path(folder) / "config.json" if isinstance(folder, str) and folder else None
    if config is None or not config.is_file():
        return None
    try:
        size = json.loads(config.read_text()).get("vocab_size")
    except (OSError, ValueError, AttributeError):
        return None
    return size if isinstance(size, int) and size > 0 else None
