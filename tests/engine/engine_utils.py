"""Helpers for engine tests: run an EngineCore to completion, and Transformers' greedy reference."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from llmrpc.engine.config import (
    CacheConfig,
    CompilationConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
)
from llmrpc.engine.core.engine_core import EngineCore
from llmrpc.engine.request import RequestOutput, SamplingParams
from llmrpc.engine.spec_decode.config import SpeculativeConfig


def make_core(
    model_dir: Path,
    dtype: str = "float32",
    num_blocks: int = 256,
    max_model_len: int | None = 512,
    compilation: CompilationConfig | None = None,
    attention_backend: str = "auto",
    device: str = "cpu",  # the CPU suite's engines run on the CPU even where CUDA is visible
    batch_invariant: bool = False,
    enable_prefix_caching: bool = True,
    kv_cache_dtype: str = "auto",
    speculative: dict | None = None,  # --speculative-config
    disable_sliding_window: bool = False,
    model_impl: str = "auto",
    **scheduler,
) -> EngineCore:
    return EngineCore(
        EngineConfig(
            model=ModelConfig(
                model=str(model_dir),
                dtype=dtype,
                max_model_len=max_model_len,
                attention_backend=attention_backend,
                device=device,
                batch_invariant=batch_invariant,
                disable_sliding_window=disable_sliding_window,
                model_impl=model_impl,
            ),
            cache=CacheConfig(
                num_gpu_blocks_override=num_blocks,
                enable_prefix_caching=enable_prefix_caching,
                cache_dtype=kv_cache_dtype,
            ),
            scheduler=SchedulerConfig(**scheduler),
            compilation=compilation or CompilationConfig(),
            speculative=SpeculativeConfig(speculative),
        )
    )


def run_to_completion(
    core: EngineCore,
    requests: dict[str, tuple[list[int], SamplingParams]],
    after_step: Callable[[], None] | None = None,
) -> dict[str, RequestOutput]:
    """Submit all requests at once and step until every one has finished; outputs merged.
    ``after_step`` is called after each step (to look at the core between steps)."""
    for request_id, (prompt, params) in requests.items():
        core.add_request(request_id, prompt, params)
    merged: dict[str, RequestOutput] = {}
    while core.has_unfinished_requests:
        for output in core.step():
            if output.request_id in merged:
                merged[output.request_id].merge(output)
            else:
                merged[output.request_id] = output
        if after_step is not None:
            after_step()
    return merged


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Transformers' own greedy generate, one prompt at a time, float32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return greedy_generate(model.eval(), prompts, max_new_tokens)


def greedy_generate(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """A Transformers model's greedy ``generate``, one prompt at a time."""
    results = []
    for prompt in prompts:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                do_sample=False,
                max_new_tokens=max_new_tokens,
            )
        results.append(out[0, len(prompt) :].tolist())
    return results


# A fixed text whose perplexity the accuracy tests compare.
FIXED_TEXT = (
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. "
    "It is named after the engineer Gustave Eiffel, whose company designed and built the tower "
    "from 1887 to 1889. Locally nicknamed the Iron Lady, it was constructed as the centrepiece "
    "of the 1889 World's Fair, and to crown the centennial anniversary of the French Revolution."
)


def engine_perplexity(core, ids: list[int]) -> float:
    """Perplexity of ``ids`` under the engine, from its prompt logprobs."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    output = run_to_completion(core, {"text": (ids, params)})["text"]
    logprobs = [entry.logprob for entry in output.prompt_logprobs[1:]]
    return math.exp(-sum(logprobs) / len(logprobs))


def transformers_perplexity(model, ids: list[int]) -> float:
    """Perplexity of ``ids`` under a Transformers model, in one forward pass."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    nll = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]))
    return math.exp(nll.item())


def bf16_linear_case(out_features: int, in_features: int, rows: int, bias: bool, seed: int = 0):
    """A bfloat16 ``nn.Linear`` of normal weights (and bias) and ``rows`` normal inputs."""
    gen = torch.Generator().manual_seed(seed)
    linear = nn.Linear(in_features, out_features, bias=bias).bfloat16()
    with torch.no_grad():
        linear.weight.copy_(torch.randn(out_features, in_features, generator=gen))
        if bias:
            linear.bias.copy_(torch.randn(out_features, generator=gen))
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    return linear, x


def vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds ``address`` (``hg``: advised
    ``MADV_HUGEPAGE``)."""
    flags, inside = None, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            first = line.split()[0]
            if "-" in first and not first.endswith(":"):
                start, end = (int(x, 16) for x in first.split("-"))
                inside = start <= address < end
            elif inside and first == "VmFlags:":
                flags = line.split()[1:]
    assert flags is not None, f"no mapping holds {address:#x}"
    return flags
