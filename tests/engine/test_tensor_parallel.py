"""--tensor-parallel-size 2 on the CPU (gloo): the same greedy tokens as one rank, a dead rank
fails the engine instead of hanging it, and a start-up that fails in rank 0 ends the others."""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import time
from pathlib import Path

import pytest
from engine_utils import run_to_completion
from process_state import children_of

from llmrpc.engine.config import (
    CacheConfig,
    CompilationConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
)
from llmrpc.engine.core.engine_core import EngineCore
from llmrpc.engine.lora.types import LoRAConfig
from llmrpc.engine.parallel.config import ParallelConfig
from llmrpc.engine.parallel.executor import WorkerDied
from llmrpc.engine.request import SamplingParams

MAX_TOKENS = 8


def engine_config(model_dir, tp: int, **parallel) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model=str(model_dir), dtype="float32", max_model_len=512, device="cpu"),
        cache=CacheConfig(num_gpu_blocks_override=64, block_size=16),
        # a 16-token budget: the long prompt is prefilled in chunks, beside decodes
        scheduler=SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=8),
        parallel=ParallelConfig(tensor_parallel_size=tp, **parallel),
    )


def greedy_tokens(core: EngineCore) -> dict[str, list[int]]:
    """Two waves: the second repeats the first's long prompt with a new tail (a prefix hit)."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    shared = [(7 * i + 3) % 4000 + 100 for i in range(40)]
    first = {"long": (shared, params), "short": ([5, 6, 7], params), "mid": (shared[:11], params)}
    tokens = {k: v.token_ids for k, v in run_to_completion(core, first).items()}
    hit = run_to_completion(core, {"hit": (shared + [11, 12, 13], params)})["hit"]
    assert hit.num_cached_tokens == 32  # the long prompt's two full blocks
    return tokens | {"hit": hit.token_ids}


@pytest.fixture(scope="module", params=["gqa_4_2_tied", "kv_heads_1_untied"])
def model_dir(request, tiny_llama_dir, tiny_model_factory):
    if request.param == "gqa_4_2_tied":
        return tiny_llama_dir
    # fewer KV heads than ranks: each rank holds a copy of the one KV head
    return tiny_model_factory(num_key_value_heads=1, tie_word_embeddings=False)


_expected: dict = {}


def one_ranks_tokens(model_dir) -> dict[str, list[int]]:
    if model_dir not in _expected:
        _expected[model_dir] = greedy_tokens(EngineCore(engine_config(model_dir, 1)))
    return _expected[model_dir]


def test_two_ranks_give_one_ranks_greedy_tokens_and_a_killed_rank_fails_the_engine(model_dir):
    expected = one_ranks_tokens(model_dir)
    core = EngineCore(engine_config(model_dir, 2))
    try:
        assert len(core.parallel.workers) == 1
        assert greedy_tokens(core) == expected
        assert all(len(tokens) == MAX_TOKENS for tokens in expected.values())
        worker = core.parallel.workers[0]
        os.kill(worker.process.pid, signal.SIGKILL)
        worker.process.join(10)
        with pytest.raises(WorkerDied, match="rank 1 .* died, exit code -9"):
            _ = core.stats  # the idle engine's stats refresh notices it
        core.add_request("r", [5, 6, 7], SamplingParams(max_tokens=2))
        with pytest.raises(WorkerDied, match="rank 1"):
            core.step()
    finally:
        core.parallel.close()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            dict(distributed_executor_backend="external_launcher"),
            "--distributed-executor-backend external_launcher is refused",
        ),
        (dict(distributed_executor_backend="uni"), "needs mp"),
    ],
)
def test_parallel_flags_refused_in_one_line(change, message):
    with pytest.raises(ValueError, match=message):
        ParallelConfig(tensor_parallel_size=2, **change)


def test_options_it_cannot_shard_are_refused_at_start(tiny_llama_dir, tiny_model_factory):
    config = engine_config(tiny_llama_dir, 2)
    with pytest.raises(ValueError, match="--enable-lora is refused with --tensor-parallel-size 2"):
        dataclasses.replace(config, lora=LoRAConfig(enabled=True))
    with pytest.raises(ValueError, match="--tensor-parallel-size 2 runs eager"):
        EngineCore(dataclasses.replace(config, compilation=CompilationConfig({"level": 3})))
    with pytest.raises(ValueError, match="9 attention heads, 3 KV heads do not split evenly"):
        EngineCore(
            engine_config(
                tiny_model_factory(num_attention_heads=9, num_key_value_heads=3, hidden_size=72), 2
            )
        )


def _spawned_children() -> set[int]:
    """This process's live children started by multiprocessing's spawn (the ranks)."""
    spawned = set()
    for pid in children_of(os.getpid()):
        try:
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                spawned.add(pid)
        except FileNotFoundError:
            pass
    return spawned


def test_a_start_up_failure_in_rank_0_ends_the_other_ranks_at_once(tiny_llama_dir, caplog):
    """--batch-invariant in float32 is refused by rank 0 once the model is loaded and sharded,
    when the other ranks hold their shards and wait for steps."""
    config = engine_config(tiny_llama_dir, 2)
    config = dataclasses.replace(
        config, model=dataclasses.replace(config.model, batch_invariant=True)
    )
    before = _spawned_children()
    logs = caplog.at_level(logging.INFO, logger="llmrpc.engine.parallel.executor")
    with logs, pytest.raises(ValueError, match="^--batch-invariant needs"):
        EngineCore(config)
    assert "tensor parallel: 2 ranks" in caplog.text  # the failure came after the ranks started
    deadline = time.monotonic() + 5
    while _spawned_children() - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _spawned_children() - before


def test_ray_ranks_give_one_ranks_greedy_tokens_and_a_dead_one_is_seen(tiny_llama_dir):
    """--distributed-executor-backend ray, on a local Ray head on loopback."""
    ray = pytest.importorskip("ray")
    ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, num_cpus=2)
    try:
        expected = one_ranks_tokens(tiny_llama_dir)
        core = EngineCore(engine_config(tiny_llama_dir, 2, distributed_executor_backend="ray"))
        try:
            assert greedy_tokens(core) == expected
            pid = core.parallel.pids[0]
            os.kill(pid, signal.SIGKILL)
            with pytest.raises(WorkerDied, match=rf"rank 1 \(Ray actor, pid {pid}\) died"):
                for _ in range(100):  # the ping in flight fails once Ray sees the death
                    _ = core.stats
                    time.sleep(0.1)
        finally:
            core.parallel.close()
    finally:
        ray.shutdown()


def test_ray_needs_a_running_cluster(monkeypatch):
    pytest.importorskip("ray")
    from llmrpc.engine.parallel.ray_executor import ray_address

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(ValueError, match="joins the Ray cluster that RAY_ADDRESS names"):
        ray_address()
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    assert ray_address() == "127.0.0.1:6379"


@pytest.mark.parametrize("model_type", ["gemma3_text", "gemma2"])
def test_two_ranks_of_gemma_give_one_ranks_greedy_tokens(tmp_path, smollm2_dir, model_type):
    """Gemma's own MLP, four norms, scaled embeddings and local/global layers, sharded (Gemma 2
    with its attention scores capped at 0.05)."""
    from tiny_models import TINY_DECODER, save_tiny_model

    config = {**TINY_DECODER, "head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 8,
              "layer_types": ["sliding_attention", "full_attention"]}  # fmt: skip
    if model_type == "gemma2":
        config["attn_logit_softcapping"] = 0.05
    model_dir = save_tiny_model(tmp_path, smollm2_dir, model_type,
                                randomize_biases_and_norms=True, **config)  # fmt: skip
    expected = greedy_tokens(EngineCore(engine_config(model_dir, 1)))
    core = EngineCore(engine_config(model_dir, 2))
    try:
        assert greedy_tokens(core) == expected
    finally:
        core.parallel.close()


@pytest.mark.parametrize(
    ("family", "expert_parallel"),
    [("qwen2_moe", False), ("qwen2_moe", True), ("mixtral", True)],
)
def test_two_ranks_of_a_moe_model_give_one_ranks_greedy_tokens(
    tmp_path, smollm2_dir, family, expert_parallel
):
    """Experts split by their features, or whole (half the experts a rank, with
    --enable-expert-parallel); Qwen2-MoE's dense layer and shared expert split as MLPs are."""
    from tiny_models import save_moe

    from llmrpc.engine.models.moe import SparseMoeBlock

    model_dir = save_moe(tmp_path, smollm2_dir, family)
    expected = greedy_tokens(EngineCore(engine_config(model_dir, 1)))
    core = EngineCore(engine_config(model_dir, 2, enable_expert_parallel=expert_parallel))
    try:
        blocks = [m for m in core.runner.model.modules() if isinstance(m, SparseMoeBlock)]
        experts = blocks[0].experts
        total = experts.total_experts
        assert experts.num_experts == (total // 2 if expert_parallel else total)
        assert greedy_tokens(core) == expected
    finally:
        core.parallel.close()


def test_moe_models_that_do_not_split_are_refused(tmp_path, smollm2_dir):
    from tiny_models import save_moe

    odd = save_moe(tmp_path / "odd", smollm2_dir, "qwen2_moe", num_experts=5)
    with pytest.raises(ValueError, match=r"5 experts \(--enable-expert-parallel\) do not split"):
        EngineCore(engine_config(odd, 2, enable_expert_parallel=True))
    olmoe = save_moe(tmp_path / "olmoe", smollm2_dir, "olmoe")
    with pytest.raises(ValueError, match="OLMoE's q and k norms span every head"):
        EngineCore(engine_config(olmoe, 2))
