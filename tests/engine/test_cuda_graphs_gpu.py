"""CUDA graphs of decode steps on a CUDA device (marked ``gpu``: skipped without one). The
engine captures them at start-up with the Triton backend; replayed steps must give the greedy
tokens of the same engine run eager (``--enforce-eager``), for a batch whose size changes as
requests join and finish, with a context too long to replay, and after sleep and wake-up (new
KV cache addresses, captured again); at -O3, the graphs hold the torch.compiled forward."""

from __future__ import annotations

import pytest
import torch
from engine_utils import make_core

from llmrpc.engine.config import (
    CacheConfig,
    CompilationConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
)
from llmrpc.engine.core.engine_core import EngineCore
from llmrpc.engine.request import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# (step it arrives at, prompt length, max_tokens); the last one's context passes 64 tokens
ARRIVALS = [(0, 5, 12), (0, 9, 4), (1, 3, 8), (2, 7, 10), (3, 4, 3), (3, 6, 9), (5, 8, 6)]
ARRIVALS += [(6, 3, 5), (8, 5, 4), (9, 70, 4)]


def _drive(core, arrivals=ARRIVALS) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    step = 0
    while step <= max(a[0] for a in arrivals) or core.has_unfinished_requests:
        for index, (at, length, max_tokens) in enumerate(arrivals):
            if at == step:
                prompt = [(37 * index + 11 * j) % 900 + 20 for j in range(length)]
                params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
                core.add_request(f"r{index}", prompt, params)
        for output in core.step():
            tokens.setdefault(output.request_id, []).extend(output.token_ids)
        step += 1
    return tokens


def _compilation(enforce_eager: bool, level: int = 0) -> CompilationConfig:
    return CompilationConfig(
        {"level": level},
        enforce_eager=enforce_eager,
        cuda_graph_sizes=(8,),
        max_seq_len_to_capture=64,
    )


@pytest.mark.parametrize("level", [0, 3])  # 3: the graphs capture the torch.compiled forward
@pytest.mark.parametrize("model", ["tiny_llama_dir", "smollm2_dir"])
def test_replayed_decode_steps_give_the_eager_tokens(model, level, request):
    model_dir = request.getfixturevalue(model)
    results = {}
    for eager in (True, False):
        core = make_core(
            model_dir,
            device="cuda",
            attention_backend="triton",
            num_blocks=128,
            max_num_seqs=8,
            max_num_batched_tokens=64,
            compilation=_compilation(eager, level),
        )
        graphs = core.runner.decode_graphs
        assert (graphs is None) == eager
        compiled = core.runner.compiled_decode
        assert (compiled is not None) == (level > 0 and not eager)
        results[eager] = _drive(core)
        if not eager:
            assert graphs.failure is None and graphs.num_replays > 0
            assert graphs.plan.sizes == (1, 2, 4, 8)
            assert compiled is None or compiled.failure is None
    assert results[False] == results[True]


def test_graphs_are_captured_again_after_sleep_and_wake_up(tiny_llama_dir):
    config = EngineConfig(
        model=ModelConfig(
            model=str(tiny_llama_dir), dtype="float32", max_model_len=512, device="cuda",
            attention_backend="triton", enable_sleep_mode=True,
        ),
        cache=CacheConfig(num_gpu_blocks_override=128),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),
        compilation=_compilation(False),
    )  # fmt: skip
    core = EngineCore(config)
    before = _drive(core)
    first = core.runner.decode_graphs
    core.sleep(1)
    assert core.runner.decode_graphs is None
    core.wake_up()
    graphs = core.runner.decode_graphs
    assert graphs is not None and graphs is not first
    assert _drive(core) == before
    assert graphs.failure is None and graphs.num_replays > 0
