"""Helpers for engine tests: run an EngineCore to completion, and Transformers' greedy reference."""

from __future__ import annotations

from pathlib import Path

import torch

from llmrpc.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from llmrpc.engine.core import EngineCore
from llmrpc.engine.request import RequestOutput, SamplingParams


def make_core(
    model_dir: Path,
    dtype: str = "float32",
    num_blocks: int = 256,
    max_model_len: int | None = 512,
    **scheduler,
) -> EngineCore:
    return EngineCore(
        EngineConfig(
            model=ModelConfig(model=str(model_dir), dtype=dtype, max_model_len=max_model_len),
            cache=CacheConfig(num_gpu_blocks_override=num_blocks),
            scheduler=SchedulerConfig(**scheduler),
        )
    )


def run_to_completion(
    core: EngineCore, requests: dict[str, tuple[list[int], SamplingParams]]
) -> dict[str, RequestOutput]:
    """Submit all requests at once and step until every one has finished; outputs merged."""
    for request_id, (prompt, params) in requests.items():
        core.add_request(request_id, prompt, params)
    merged: dict[str, RequestOutput] = {}
    while core.has_unfinished_requests:
        for output in core.step():
            if output.request_id in merged:
                merged[output.request_id].merge(output)
            else:
                merged[output.request_id] = output
    return merged


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Transformers' own greedy generate, one prompt at a time, float32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
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


TINY_DECODER = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}


def save_tiny_model(out_dir: Path, tokenizer_dir: Path, config_class: str, **overrides) -> Path:
    """A random-weight float32 model of any Transformers config class, with a real tokenizer."""
    import transformers

    from llmrpc.engine.loader import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_dir)
    config = getattr(transformers, config_class)(
        **{**TINY_DECODER, **overrides},
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config).to(torch.float32)
        _randomize_biases_and_norms(model)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir


@torch.no_grad()
def _randomize_biases_and_norms(model) -> None:
    """Transformers initialises biases to 0 and norms to 1, which would hide a dropped bias."""
    for name, param in model.named_parameters():
        if "norm" in name:
            param.copy_(1 + 0.1 * torch.randn_like(param))
        elif name.endswith(".bias"):
            param.copy_(0.1 * torch.randn_like(param))
