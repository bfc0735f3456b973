"""The whole engine on ``--attention-backend triton``, its kernels interpreted on the CPU
(``TRITON_INTERPRET=1``, set by tests/conftest.py without a GPU): the same greedy tokens as the
torch backend for a batch that mixes chunked prefill, a prefix-cache hit and preemption."""

from __future__ import annotations

import pytest
import torch
from engine_utils import make_core, run_to_completion

from llmrpc.engine.config import CompilationConfig
from llmrpc.engine.core import engine_core as core_module
from llmrpc.engine.request import SamplingParams
from llmrpc.engine.runner.compilation import WARM_UP_NUM_TOKENS, CompiledDecode
from llmrpc.engine.runner.device import resolve_attention_backend, resolve_device


def _spy(core) -> dict[str, set]:
    """Record what the scheduler did: preempted requests, and chunks that left a prompt partial."""
    seen: dict[str, set] = {"preempted": set(), "partial_prefills": set()}
    schedule = core.scheduler.schedule

    def spying_schedule():
        output = schedule()
        seen["preempted"].update(r.request_id for r in output.preempted)
        for request, num_new in output.scheduled:
            if request.num_computed_tokens + num_new < request.num_prompt_tokens:
                seen["partial_prefills"].add(request.request_id)
        return output

    core.scheduler.schedule = spying_schedule
    return seen


def _run(tiny_llama_dir, backend: str, compilation: CompilationConfig | None = None):
    # 20 blocks of 16 tokens hold about 4 of the 8 requests at full length: some are preempted.
    core = make_core(
        tiny_llama_dir,
        num_blocks=20,
        max_model_len=256,
        max_num_batched_tokens=48,
        attention_backend=backend,
        compilation=compilation or CompilationConfig(),
    )
    assert core.runner.backend == backend
    if compilation is not None:
        assert core.runner.compiled_decode is not None
        assert core.runner.compiled_decode.failure is None
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    shared = [(11 * j) % 400 + 20 for j in range(40)]
    first = run_to_completion(core, {"first": (shared + [5, 6, 7], params)})
    seen = _spy(core)
    # "hit" is scheduled first, before the others can evict the 32 tokens "first" cached
    prompts = {"hit": shared + [8, 9]}
    prompts |= {f"r{i}": [(7 * i + j) % 500 + 10 for j in range(3 + 9 * i)] for i in range(7)}
    outputs = run_to_completion(core, {k: (p, params) for k, p in prompts.items()})
    outputs["first"] = first["first"]
    return outputs, seen


@pytest.fixture(scope="module")
def triton_run(tiny_llama_dir):
    """The Triton backend's eager run (interpreted: about 10 s), for the tests that compare it."""
    return _run(tiny_llama_dir, "triton")


def test_triton_backend_gives_the_torch_backends_greedy_tokens(tiny_llama_dir, triton_run):
    expected, _ = _run(tiny_llama_dir, "torch")
    outputs, seen = triton_run
    assert {k: o.token_ids for k, o in outputs.items()} == {
        k: o.token_ids for k, o in expected.items()
    }
    assert outputs["hit"].num_cached_tokens == 32
    assert seen["preempted"], "no request was preempted"
    assert len(seen["partial_prefills"]) >= 2, seen


def test_triton_on_the_cpu_needs_the_interpreter(monkeypatch):
    cpu = resolve_device("cpu")
    assert resolve_attention_backend("auto", cpu) == "torch"
    assert resolve_attention_backend("triton", cpu) == "triton"  # interpreted here
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="--attention-backend triton runs on a CUDA device"):
        resolve_attention_backend("triton", cpu)
    assert resolve_attention_backend("torch", cpu) == "torch"


def test_a_compiled_triton_engine_gives_eager_tokens(tiny_llama_dir, triton_run, monkeypatch):
    """-O3 on the Triton backend: the compiled decode step, its Triton kernels operations of the
    graph (kernel_ops/triton_ops.py), interpreted here, gives eager's greedy tokens for the same
    mixed batch; its decodes-only steps ran compiled, from the graph compiled at load."""
    expected, _ = triton_run
    calls = [0]
    make = CompiledDecode.__call__

    def counting(self, *args):
        hidden = make(self, *args)
        calls[0] += hidden is not None
        return hidden

    monkeypatch.setattr(CompiledDecode, "__call__", counting)
    outputs, _ = _run(tiny_llama_dir, "triton", CompilationConfig({"level": 3}))
    assert {k: o.token_ids for k, o in outputs.items()} == {
        k: o.token_ids for k, o in expected.items()
    }
    assert calls[0] > len(WARM_UP_NUM_TOKENS) + 10  # the warm-up's, then the decode steps'


def test_compiling_the_torch_backend_on_cuda_is_refused(tiny_llama_dir, monkeypatch):
    """On CUDA the compiled decode step is the Triton backend's: -O3 with the torch backend
    stops start-up (checked before anything touches the device)."""
    monkeypatch.setattr(core_module, "resolve_device", lambda name: torch.device("cuda"))
    with pytest.raises(ValueError, match="with --attention-backend triton .* only; with torch"):
        make_core(
            tiny_llama_dir, attention_backend="torch", compilation=CompilationConfig({"level": 3})
        )


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible")
def test_device_cuda_without_a_device_is_refused_naming_the_flag():
    with pytest.raises(ValueError, match="--device cuda: no CUDA device is visible"):
        resolve_device("cuda")
    assert resolve_device("auto").type == "cpu"
