"""The engine on a CUDA device (marked ``gpu``: skipped without one; on the CPU in the device
check's dry run). The same comparisons the CPU
suite makes, natively: greedy tokens token-exact against Transformers on SmolLM2 in float32 on
both attention backends, and the Triton backend's tokens equal to the torch backend's in a batch
with chunked prefill, a prefix hit and preemption; a MoE model's tokens against Transformers'."""

from __future__ import annotations

import pytest
import torch
from device_target import DEVICE, ON_DEVICE
from engine_utils import greedy_generate, make_core, run_to_completion

from llmrpc.engine.request import SamplingParams

pytestmark = ON_DEVICE

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a kingdom far away, there lived a",
    "1, 2, 3, 4, 5,",
]


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_smollm2_on_cuda_matches_transformers_token_for_token(smollm2_dir, backend):
    from transformers import AutoModelForCausalLM

    core = make_core(
        smollm2_dir, device=DEVICE, attention_backend=backend, max_num_batched_tokens=16
    )
    assert core.runner.device.type == DEVICE and core.runner.backend == backend
    prompts = [core.tokenizer.encode(text) for text in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outputs = run_to_completion(core, {str(i): (p, params) for i, p in enumerate(prompts)})
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    expected = greedy_generate(_OnDevice(model.to(DEVICE).eval()), prompts, 24)
    assert [outputs[str(i)].token_ids for i in range(len(prompts))] == expected


class _OnDevice:
    """A Transformers model whose ``generate`` takes host tensors (greedy_generate makes them)."""

    def __init__(self, model) -> None:
        self.model = model

    def generate(self, input_ids, attention_mask, **kwargs):
        device = self.model.device
        return self.model.generate(
            input_ids.to(device), attention_mask=attention_mask.to(device), **kwargs
        ).cpu()


def test_triton_and_torch_backends_agree_on_cuda_under_pressure(tiny_llama_dir):
    results = {}
    for backend in ("torch", "triton"):
        core = make_core(
            tiny_llama_dir,
            device=DEVICE,
            attention_backend=backend,
            num_blocks=20,
            max_model_len=256,
            max_num_batched_tokens=48,
        )
        params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
        shared = [(11 * j) % 400 + 20 for j in range(40)]
        run_to_completion(core, {"first": (shared + [5, 6, 7], params)})
        prompts = {"hit": shared + [8, 9]}
        prompts |= {f"r{i}": [(7 * i + j) % 500 + 10 for j in range(3 + 9 * i)] for i in range(7)}
        outputs = run_to_completion(core, {k: (p, params) for k, p in prompts.items()})
        assert outputs["hit"].num_cached_tokens == 32
        results[backend] = {k: o.token_ids for k, o in outputs.items()}
    assert results["triton"] == results["torch"]


def test_a_moe_model_on_cuda_matches_transformers(tmp_path, smollm2_dir):
    """Qwen2-MoE (routed experts, a shared one, a dense layer) with the fused experts' Triton
    kernels compiled for the device: float32 greedy tokens equal Transformers' on the CPU."""
    from engine_utils import hf_greedy
    from tiny_models import save_moe

    model_dir = save_moe(tmp_path, smollm2_dir, "qwen2_moe")
    core = make_core(model_dir, device=DEVICE, attention_backend="triton",
                     max_num_batched_tokens=32)  # fmt: skip
    prompts = [core.tokenizer.encode(text) for text in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outputs = run_to_completion(core, {str(i): (p, params) for i, p in enumerate(prompts)})
    expected = hf_greedy(model_dir, prompts, 16)
    assert [outputs[str(i)].token_ids for i in range(len(prompts))] == expected
