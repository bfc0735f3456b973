"""--tensor-parallel-size 2 on two CUDA devices over NCCL (marked ``gpu``; skipped with fewer than
two devices): one rank's greedy tokens in float32, with the KV cache sized by profiling on each
rank, and a rank that dies, idle or in the middle of a step, fails the engine instead of
leaving it waiting in a collective."""

from __future__ import annotations

import dataclasses
import gc
import os
import signal
import threading

import pytest
import torch
from test_tensor_parallel import engine_config, greedy_tokens

from llmrpc.engine.config import CacheConfig
from llmrpc.engine.core.engine_core import EngineCore
from llmrpc.engine.parallel.executor import WorkerDied
from llmrpc.engine.request import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        torch.cuda.device_count() < 2,
        reason=f"needs two CUDA devices (NCCL ranks); {torch.cuda.device_count()} visible",
    ),
]


def cuda_config(model_dir, tp: int, profile: bool = False):
    """The CPU test's engine on CUDA; ``profile``: KV blocks from --gpu-memory-utilization."""
    config = engine_config(model_dir, tp)
    cache = CacheConfig(block_size=16, gpu_memory_utilization=0.3) if profile else config.cache
    return dataclasses.replace(
        config, model=dataclasses.replace(config.model, device="cuda"), cache=cache
    )


@pytest.fixture(params=["gqa_4_2_tied", "kv_heads_1_untied"])
def model_dir(request, tiny_llama_dir, tiny_model_factory):
    if request.param == "gqa_4_2_tied":
        return tiny_llama_dir
    return tiny_model_factory(num_key_value_heads=1, tie_word_embeddings=False)


def free_device_memory() -> None:
    """Drop engines no longer referenced: a profiled start counts live tensors as used."""
    gc.collect()
    torch.cuda.empty_cache()


def test_two_cuda_ranks_give_one_ranks_greedy_tokens(model_dir):
    free_device_memory()
    expected = greedy_tokens(EngineCore(cuda_config(model_dir, 1)))
    free_device_memory()
    core = EngineCore(cuda_config(model_dir, 2, profile=True))
    try:
        assert core.runner.device == torch.device("cuda", 0)
        assert core.kv_manager.num_blocks >= 32  # the fewest of both ranks' measurements
        assert greedy_tokens(core) == expected
    finally:
        core.parallel.close()


def test_a_cuda_rank_that_dies_while_the_engine_is_idle_fails_it(tiny_llama_dir):
    free_device_memory()
    core = EngineCore(cuda_config(tiny_llama_dir, 2))
    try:
        worker = core.parallel.workers[0]
        os.kill(worker.process.pid, signal.SIGKILL)
        worker.process.join(10)
        with pytest.raises(WorkerDied, match="rank 1 .* died, exit code -9"):
            _ = core.stats
        core.add_request("r", [5, 6, 7], SamplingParams(max_tokens=2))
        with pytest.raises(WorkerDied, match="rank 1"):
            core.step()
    finally:
        core.parallel.close()


def test_a_cuda_rank_that_dies_mid_step_fails_the_step(tiny_llama_dir):
    free_device_memory()
    core = EngineCore(cuda_config(tiny_llama_dir, 2))
    try:
        worker = core.parallel.workers[0]
        os.kill(worker.process.pid, signal.SIGSTOP)  # alive, but in no collective
        core.add_request("r", [5, 6, 7], SamplingParams(max_tokens=2))
        failure: list[BaseException] = []

        def step() -> None:
            try:
                core.step()  # waits in NCCL for the stopped rank
            except BaseException as error:  # noqa: BLE001 - what the test inspects
                failure.append(error)

        stepping = threading.Thread(target=step, daemon=True)
        stepping.start()
        stepping.join(3)
        assert stepping.is_alive()  # NCCL does not fail a collective whose peer is late
        os.kill(worker.process.pid, signal.SIGKILL)
        stepping.join(60)
        assert not stepping.is_alive()
        assert isinstance(failure[0], WorkerDied)
        assert "tensor-parallel rank 1" in str(failure[0])
        assert "died, exit code -9" in str(failure[0])
        with pytest.raises(WorkerDied, match="rank 1 .* died, exit code -9"):
            _ = core.stats
    finally:
        core.parallel.close()
