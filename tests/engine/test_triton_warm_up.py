"""Start-up with the triton backend compiles, before the first request, every Triton kernel
variant a server's steps need (engine/runner/kernel_warm_up.py, on CUDA), and Triton keeps what it
compiled in the model cache folder. On the CPU the kernels run in Triton's interpreter, and
Triton's own binder gives the compile key each launch would have on a GPU
(tests/triton_compile_keys.py): a key the warm-up did not have is a compile at a request."""

from __future__ import annotations

import os

import pytest
from engine_utils import make_core, run_to_completion
from triton_compile_keys import recorded_compile_keys

from llmrpc.engine.loading.loader import CACHE_ENV
from llmrpc.engine.request import SamplingParams
from llmrpc.engine.runner.kernel_warm_up import (
    TRITON_CACHE_ENV,
    triton_cache_dir,
    warm_up_triton_kernels,
)
from llmrpc.kernels.triton_utils import interpreting

KERNELS = {
    "_store_kv_kernel", "_decode_split_kernel", "_decode_reduce_kernel", "_prefill_kernel",
    "_rms_norm_kernel", "_rotary_kernel", "_sample_kernel",
}  # fmt: skip


def _params(max_tokens: int, **sampling) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens, ignore_eos=True, **{"temperature": 0.0, **sampling}
    )


@pytest.mark.skipif(not interpreting(), reason="records the compiles of the interpreter's launches")
def test_no_step_needs_a_kernel_variant_the_warm_up_did_not_compile(tiny_llama_dir):
    """Prompts of 1, 5, 17, 40 and 150 tokens (chunks of at most 64), greedy and sampled with
    top-k and top-p, joining a running batch: decodes-only and mixed steps of 1 to 5 rows,
    contexts 1 to 11 blocks wide, decode at 1 split and at several."""
    core = make_core(
        tiny_llama_dir, attention_backend="triton", max_num_batched_tokens=64, max_num_seqs=8
    )
    runner = core.runner
    with recorded_compile_keys() as warm:
        warm_up_triton_kernels(runner.model, runner.kv_caches, runner.block_size, 64, 512)
    sampled = {"temperature": 0.8, "top_k": 20, "top_p": 0.9, "seed": 1}
    with recorded_compile_keys() as served:
        run_to_completion(core, {"one": ([7], _params(3)), "long": (list(range(150)), _params(2))})
        run_to_completion(
            core,
            {
                "short": ([5, 6, 7, 8, 9], _params(3, **sampled)),
                "mid": (list(range(300, 317)), _params(4)),
                "forty": (list(range(500, 540)), _params(2, **{**sampled, "top_p": 0.5})),
            },
        )
    assert set(served) == KERNELS  # the workload reached every kernel
    for name, keys in served.items():
        assert keys <= warm[name], f"{name}: {len(keys - warm[name])} variant(s) compiled late"


@pytest.mark.skipif(not interpreting(), reason="records the compiles of the interpreter's launches")
def test_a_moe_models_steps_need_no_experts_kernel_variant_the_warm_up_did_not_compile(
    tmp_path, smollm2_dir
):
    """Qwen3-MoE (8 experts, top-2): steps of 1 to 256 tokens take the experts' kernels at
    blocks of 16, 32 and 64 pairs; the warm-up compiled each."""
    from tiny_models import save_moe

    model_dir = save_moe(tmp_path, smollm2_dir, "qwen3_moe")
    core = make_core(
        model_dir, attention_backend="triton", max_num_batched_tokens=256, max_num_seqs=8
    )
    runner = core.runner
    with recorded_compile_keys() as warm:
        warm_up_triton_kernels(runner.model, runner.kv_caches, runner.block_size, 256, 512)
    with recorded_compile_keys() as served:  # one at a time: steps of 1, 70 and 256 tokens
        for prompt in ([7], list(range(100, 170)), list(range(300, 700))):
            run_to_completion(core, {"r": (prompt, _params(2))})
    experts = {"_gate_up_kernel", "_down_kernel"}
    assert experts <= set(served)
    assert len(served["_gate_up_kernel"]) == 3  # a step at each block size
    for name, keys in served.items():
        assert keys <= warm[name], f"{name}: {len(keys - warm[name])} variant(s) compiled late"


def test_triton_keeps_its_kernels_in_the_model_cache_folder(tiny_llama_dir, tmp_path, monkeypatch):
    """Unset, $TRITON_CACHE_DIR is set at the engine's start to the triton folder of the model
    cache ($LLMRPC_CACHE_DIR here); a folder the user set stays."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    monkeypatch.setenv(TRITON_CACHE_ENV, "unset below")  # so that the test's end restores it
    monkeypatch.delenv(TRITON_CACHE_ENV)
    make_core(tiny_llama_dir, num_blocks=32)
    assert os.environ[TRITON_CACHE_ENV] == str(tmp_path / "triton")
    assert triton_cache_dir() == tmp_path / "triton"
    monkeypatch.setenv(TRITON_CACHE_ENV, str(tmp_path / "mine"))
    assert triton_cache_dir() == tmp_path / "mine"
    assert os.environ[TRITON_CACHE_ENV] == str(tmp_path / "mine")
