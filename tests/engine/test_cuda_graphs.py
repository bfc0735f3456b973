"""CUDA graphs of decode steps (engine/runner/cuda_graphs.py), their plumbing on the CPU.

A stand-in capture (patched in for the runner's ``CudaGraphCapture``) takes the place of
``torch.cuda.graph``: its replay runs the captured forward again on the same static buffers and
writes into the same output tensor, which is what a replay is (same buffers, fresh values).
Everything else is the engine's own: the buckets, the padding rows, the copies into the static
buffers, the fallbacks. The tiny model runs on the torch backend here, whose C++ decode kernel
takes short prompt chunks as decode rows, so prompt steps replay too; the Triton backend
(interpreted) runs once, for its store kernel's padding.
"""

from __future__ import annotations

import logging
from unittest import mock

import pytest
import torch
from engine_utils import make_core

from llmrpc.common.args import OneLineErrorParser
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
from llmrpc.engine.request import SamplingParams
from llmrpc.engine.runner import model_runner
from llmrpc.engine.runner.compilation import WARM_UP_NUM_TOKENS, CompiledDecode
from llmrpc.engine.runner.cuda_graphs import (
    DecodeGraphPlan,
    capture_sizes,
    plan_decode_graphs,
    why_not_captured,
)
from llmrpc.kernels.attention import AttentionMetadata, write_kv
from llmrpc.kernels.triton_attention import store_kv_torch
from llmrpc.server import options

SENTINEL = 7.25  # what every KV slot holds before a run; no real key or value equals it
BLOCK_SIZE = 16
SIZES = capture_sizes((16,), 10)  # 1, 2, 4, 8, 10
PLAN = DecodeGraphPlan(SIZES, 64)  # contexts up to 64 tokens: 4 blocks wide


class RerunCapture:
    """The stand-in: a replay runs the captured forward again on the buffers it was given."""

    def __init__(self, fail_capture: bool = False, fail_at_replay: int | None = None) -> None:
        self.fail_capture = fail_capture
        self.fail_at_replay = fail_at_replay
        self.replayed: list[int] = []  # the bucket of each replay
        self.captured: list[int] = []  # the bucket of each capture, in order

    def warm_up(self, forward) -> None:
        forward()

    def capture(self, forward):
        if self.fail_capture:
            raise RuntimeError("operation not permitted when stream is capturing")
        output = forward()
        size = output.shape[0]
        self.captured.append(size)

        def replay() -> None:
            if len(self.replayed) == self.fail_at_replay:  # in Python, as a stand-in can
                raise RuntimeError("expected a tensor on cuda:0, got one on cpu")
            self.replayed.append(size)
            output.copy_(forward())

        return replay, output


def _core(model_dir, backend: str = "torch", capture: RerunCapture | None = None, **more):
    core = make_core(
        model_dir,
        num_blocks=64,
        max_model_len=512,
        attention_backend=backend,
        max_num_seqs=10,
        max_num_batched_tokens=64,
        **more,
    )
    if capture is not None:
        core.graph_plan = PLAN  # as plan_decode_graphs gives on a CUDA device
        with _capturing(capture):
            assert core.runner.capture_decode_graphs(PLAN) or capture.fail_capture
    return core


def _capturing(capture: RerunCapture):
    """The runner's captures are the stand-in's while this context lasts."""
    return mock.patch.object(model_runner, "CudaGraphCapture", lambda device: capture)


# (step it arrives at, prompt length, max_tokens): the batch grows to 10 requests and shrinks,
# so decode steps take every row count from 1 to 10, bucket sizes and counts between them.
ARRIVALS = [(0, 5, 14), (0, 7, 3), (1, 3, 6), (2, 9, 12), (3, 4, 2), (3, 6, 9), (4, 5, 11)]
ARRIVALS += [(5, 8, 7), (5, 3, 10), (6, 4, 5), (9, 6, 4), (16, 5, 3), (17, 4, 2), (18, 3, 3)]
ARRIVALS += [(19, 2, 2), (20, 3, 2), (21, 4, 2), (22, 2, 2)]
# late and long: a 300-token prompt, whose chunks attend past the 256 tokens of context that
# the C++ decode kernel takes as decode rows (eager prefill steps), and whose decode steps'
# context exceeds the plan's 64 tokens (eager decode steps)
LONG = (26, 300, 4)


def _prompt(index: int, length: int) -> list[int]:
    return [(37 * index + 11 * j) % 900 + 20 for j in range(length)]


def _drive(core, arrivals=ARRIVALS + [LONG]) -> tuple[dict[str, list[int]], list[dict]]:
    """Run the arrivals step by step: each request's tokens, and what each step ran."""
    steps = _spy(core)
    tokens: dict[str, list[int]] = {}
    step = 0
    while step <= max(a[0] for a in arrivals) or core.has_unfinished_requests:
        for index, (at, length, max_tokens) in enumerate(arrivals):
            if at == step:
                params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
                core.add_request(f"r{index}", _prompt(index, length), params)
        for output in core.step():
            tokens.setdefault(output.request_id, []).extend(output.token_ids)
        step += 1
    return tokens, steps


def _spy(core) -> list[dict]:
    """Record each executed step: rows, decodes-only, longest context, real slots, replay."""
    runner, steps = core.runner, []
    prepare, execute = runner.prepare_input, runner.execute
    graphs = runner.decode_graphs
    capture = graphs._capture if graphs is not None else None

    def recording_prepare(output, block_ids):
        model_input = prepare(output, block_ids)
        steps.append(
            {
                "rows": len(model_input.input_ids),
                "decodes_only": model_input.metadata.decodes_only,
                "max_len": model_input.max_decode_seq_len,
                "slots": model_input.metadata.slot_mapping.tolist(),
                "bucket": None,
            }
        )
        return model_input

    def recording_execute(output, block_ids):
        before = len(capture.replayed) if capture else 0
        result = execute(output, block_ids)
        if capture and len(capture.replayed) > before:
            steps[-1]["bucket"] = capture.replayed[-1]
        return result

    runner.prepare_input = recording_prepare
    runner.execute = recording_execute
    return steps


def _graph_logs(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "llmrpc.engine.runner.cuda_graphs"]


@pytest.fixture(scope="module")
def eager_run(tiny_llama_dir):
    """The arrivals run eager from a poisoned cache: each request's tokens, and the cache."""
    core = _core(tiny_llama_dir)
    _poison(core)
    tokens, steps = _drive(core)
    assert max(s["rows"] for s in steps if s["decodes_only"]) > SIZES[-1]  # some run eager
    return tokens, core.runner.kv_caches


@pytest.fixture(scope="module")
def eager_tokens(eager_run) -> dict[str, list[int]]:
    return eager_run[0]


def _poison(core) -> None:
    for key_cache, value_cache in core.runner.kv_caches:
        key_cache.fill_(SENTINEL)
        value_cache.fill_(SENTINEL)


def _untouched_outside(core, written: set[int]) -> None:
    """Every KV slot no real row wrote still holds the sentinel, in every layer."""
    num_slots = core.runner.kv_caches[0][0].shape[0] * BLOCK_SIZE
    others = torch.tensor(sorted(set(range(num_slots)) - written))
    assert len(others) >= 4 * BLOCK_SIZE
    for key_cache, value_cache in core.runner.kv_caches:
        for cache in (key_cache, value_cache):
            rows = cache.view(num_slots, -1)[others]
            assert bool((rows == SENTINEL).all()), "a padding row wrote the KV cache"


def test_replayed_steps_give_eager_tokens_and_padding_writes_no_kv_slot(tiny_llama_dir, eager_run):
    eager_tokens, eager_caches = eager_run
    capture = RerunCapture()
    core = _core(tiny_llama_dir, capture=capture)
    assert capture.captured == [10, 8, 4, 2, 1]  # largest first
    _poison(core)
    tokens, steps = _drive(core)
    assert tokens == eager_tokens
    # slot for slot what eager wrote: a padding row wrote no slot, a real one's nor a free one's
    for caches, eager in zip(core.runner.kv_caches, eager_caches, strict=True):
        for cache, expected in zip(caches, eager, strict=True):
            torch.testing.assert_close(cache, expected, rtol=1e-5, atol=1e-5)
    replayed = [s for s in steps if s["bucket"] is not None]
    assert all(s["decodes_only"] and s["rows"] <= s["bucket"] for s in replayed)
    # every bucket replayed, at its own size and padded from a smaller count
    assert {s["bucket"] for s in replayed if s["rows"] == s["bucket"]} == set(SIZES)
    padded = {(s["rows"], s["bucket"]) for s in replayed if s["rows"] < s["bucket"]}
    assert {(3, 4), (5, 8)} <= padded
    # each step replayed exactly where it qualifies: decodes only, in a bucket, context <= 64
    for s in steps:
        qualifies = s["decodes_only"] and s["rows"] <= SIZES[-1] and s["max_len"] <= 64
        assert (s["bucket"] is not None) == qualifies, s
        if qualifies:
            assert s["bucket"] == min(size for size in SIZES if size >= s["rows"])
    assert any(s["decodes_only"] and s["max_len"] > 64 and s["rows"] <= 10 for s in steps)
    assert any(not s["decodes_only"] for s in steps)  # the long prompt's chunks: eager
    written = {slot for s in steps for slot in s["slots"]}
    assert -1 not in written
    _untouched_outside(core, written)
    assert core.runner.decode_graphs.failure is None


def test_triton_backend_replays_with_its_store_kernel_skipping_padding(tiny_llama_dir):
    arrivals = [(0, 4, 3), (0, 6, 4), (0, 5, 2)]  # a prompt step, then 3 decode rows in bucket 4,
    # 2, 1
    eager, _ = _drive(_core(tiny_llama_dir, "triton"), arrivals)
    capture = RerunCapture()
    core = _core(tiny_llama_dir, "triton", capture)
    _poison(core)
    tokens, steps = _drive(core, arrivals)
    assert tokens == eager
    assert {(s["rows"], s["bucket"]) for s in steps if s["bucket"]} == {(3, 4), (2, 2), (1, 1)}
    assert all(s["bucket"] is None for s in steps if not s["decodes_only"])  # prompts: eager
    _untouched_outside(core, {slot for s in steps for slot in s["slots"]})


def test_compiled_triton_steps_are_what_the_graphs_capture(tiny_llama_dir, monkeypatch):
    """-O3 with graphs: each bucket captures the compiled forward (its Triton kernels nodes of
    the graph, kernel_ops/triton_ops.py), and the replays give eager's tokens."""
    arrivals = [(0, 4, 3), (0, 6, 4), (0, 5, 2)]
    eager, _ = _drive(_core(tiny_llama_dir, "triton"), arrivals)
    compiled_calls = []
    call = CompiledDecode.__call__

    def counting(self, input_ids, *args):
        hidden = call(self, input_ids, *args)
        compiled_calls.append(None if hidden is None else len(input_ids))
        return hidden

    monkeypatch.setattr(CompiledDecode, "__call__", counting)
    capture = RerunCapture()
    core = _core(tiny_llama_dir, "triton", capture, compilation=CompilationConfig({"level": 3}))
    compiled = core.runner.compiled_decode
    assert compiled is not None and compiled.failure is None
    warm_up = len(WARM_UP_NUM_TOKENS)
    # per bucket, largest first: the capture's warm-up and the capture itself
    assert compiled_calls[warm_up:] == [size for size in reversed(SIZES) for _ in (0, 1)]
    _poison(core)
    tokens, steps = _drive(core, arrivals)
    assert tokens == eager
    replays = [s["bucket"] for s in steps if s["bucket"]]
    assert sorted(replays) == [1, 2, 4]
    # each replay ran the compiled forward; no step ran it outside a graph
    assert compiled_calls[warm_up + 2 * len(SIZES) :] == sorted(replays, reverse=True)
    _untouched_outside(core, {slot for s in steps for slot in s["slots"]})


def test_padding_rows_of_the_static_buffers(tiny_llama_dir):
    """After a full bucket, a smaller step's padding rows are reset: slot -1, context 1,
    block table zeros; the step's rows are its own, its table widened with zeros."""
    core = _core(tiny_llama_dir, capture=RerunCapture())
    graphs = core.runner.decode_graphs
    inputs = graphs._inputs

    def step(rows: int, width: int):
        metadata = AttentionMetadata(
            slot_mapping=torch.arange(rows) + 100,
            decode_indices=torch.arange(rows),
            decode_block_tables=torch.arange(rows * width).view(rows, width) + 1,
            decode_seq_lens=width * BLOCK_SIZE - torch.arange(rows),
            prefills=[],
            decodes_only=True,
        )
        ids = torch.arange(rows) + 50
        with torch.inference_mode():  # as ModelRunner.execute runs
            return graphs(ids, ids, metadata, width * BLOCK_SIZE)

    assert step(8, 4).shape[0] == 8
    assert step(5, 2).shape[0] == 5  # bucket 8: rows 5-7 are padding
    assert inputs.slot_mapping[:8].tolist() == [100, 101, 102, 103, 104] + [-1] * 3
    assert inputs.decode_seq_lens[:8].tolist() == [32, 31, 30, 29, 28] + [1] * 3
    tables = inputs.decode_block_tables[:8]
    assert tables[:5].tolist() == [[2 * i + 1, 2 * i + 2, 0, 0] for i in range(5)]
    assert not tables[5:].any()
    assert step(3, 1).shape[0] == 3  # bucket 4
    assert inputs.slot_mapping[:4].tolist() == [100, 101, 102, -1]
    assert inputs.decode_block_tables[:4].tolist() == [[j + 1, 0, 0, 0] for j in range(3)] + [
        [0] * 4
    ]
    assert step(11, 1) is None  # more rows than the largest bucket
    assert step(2, 5) is None  # a context past --max-seq-len-to-capture (80 > 64)
    assert graphs.num_replays == 3


def test_a_failed_capture_is_logged_once_and_the_engine_runs_eager(
    tiny_llama_dir, eager_tokens, caplog
):
    capture = RerunCapture(fail_capture=True)
    with caplog.at_level(logging.WARNING, logger="llmrpc.engine.runner.cuda_graphs"):
        core = _core(tiny_llama_dir, capture=capture)
        tokens, steps = _drive(core)
    assert core.runner.decode_graphs is None
    assert tokens == eager_tokens and not capture.replayed
    assert _graph_logs(caplog) == [
        "Capturing a CUDA graph of the decode step failed, decode steps run eager from now on "
        "(unless the device faulted: CUDA's error is sticky, every later step fails): "
        "RuntimeError: operation not permitted when stream is capturing"
    ]


def test_a_replay_that_raises_runs_its_step_again_eager_and_drops_the_graphs(
    tiny_llama_dir, eager_tokens, caplog
):
    """An error raised in Python at a replay (the stand-in's; a fault on the device, whose CUDA
    error is sticky, cannot be recovered from and is not shown here)."""
    capture = RerunCapture(fail_at_replay=5)
    with caplog.at_level(logging.WARNING, logger="llmrpc.engine.runner.cuda_graphs"):
        core = _core(tiny_llama_dir, capture=capture)
        tokens, steps = _drive(core)
    assert tokens == eager_tokens
    assert len(capture.replayed) == 5  # none after the failure
    assert (
        core.runner.decode_graphs.failure
        == "RuntimeError: expected a tensor on cuda:0, got one on cpu"
    )
    (message,) = _graph_logs(caplog)
    assert message.startswith("Replaying a CUDA graph of the decode step failed, decode steps run")


def test_sleep_drops_the_graphs_and_wake_up_captures_them_again(tiny_llama_dir):
    """The graphs hold the KV cache's addresses: after a new cache, replays must use it."""
    config = EngineConfig(
        model=ModelConfig(
            model=str(tiny_llama_dir), dtype="float32", max_model_len=512, device="cpu",
            enable_sleep_mode=True,
        ),
        cache=CacheConfig(num_gpu_blocks_override=64),
        scheduler=SchedulerConfig(max_num_seqs=10, max_num_batched_tokens=64),
    )  # fmt: skip
    arrivals = [(0, 4, 5), (0, 6, 4), (1, 5, 3)]
    core = EngineCore(config)
    eager, _ = _drive(core, arrivals)
    capture = RerunCapture()
    core.graph_plan = PLAN
    with _capturing(capture):
        core.runner.capture_decode_graphs(PLAN)
        core.sleep(1)
        assert core.runner.decode_graphs is None
        core.wake_up()
    assert core.runner.decode_graphs is not None and capture.captured == list(SIZES[::-1]) * 2
    tokens, _ = _drive(core, arrivals)
    assert tokens == eager and capture.replayed


def test_the_torch_store_skips_the_padding_rows_of_a_padded_step():
    key, value = torch.randn(4, 2, 8), torch.randn(4, 2, 8)
    slots = torch.tensor([3, -1, 9, -1])
    caches = [torch.full((2, BLOCK_SIZE, 2, 8), SENTINEL) for _ in range(4)]
    metadata = AttentionMetadata(
        slot_mapping=slots,
        decode_indices=torch.arange(4),
        decode_block_tables=torch.zeros(4, 1, dtype=torch.long),
        decode_seq_lens=torch.ones(4, dtype=torch.long),
        prefills=[],
        decodes_only=True,
        padded=True,
    )
    write_kv(key, value, caches[0], caches[1], metadata)
    store_kv_torch(key, value, caches[2], caches[3], slots)  # the Triton store's twin
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    flat = caches[0].view(-1, 2, 8)
    assert torch.equal(flat[3], key[0]) and torch.equal(flat[9], key[2])
    others = [slot for slot in range(2 * BLOCK_SIZE) if slot not in (3, 9)]
    assert bool((flat[others] == SENTINEL).all())


# --- buckets, configuration, where graphs are not captured ------------------------------------


@pytest.mark.parametrize(
    ("flag", "max_num_seqs", "sizes"),
    [
        ((), 256, (1, 2, 4, *range(8, 257, 8))),  # vLLM's default: min(2 * 256, 512), capped
        ((), 4, (1, 2, 4)),  # min(8, 512): 1, 2, 4, 8, capped at 4
        ((), 20, (1, 2, 4, 8, 16, 20)),  # 40: ..., 32, 40 capped at 20
        ((16,), 256, (1, 2, 4, 8, 16)),
        ((3,), 256, (1, 2)),
        ((1, 2, 128), 64, (1, 2, 64)),
        ((24, 8, 8), 256, (8, 24)),
    ],
)
def test_capture_sizes_from_the_flag(flag, max_num_seqs, sizes):
    assert capture_sizes(flag, max_num_seqs) == sizes


def test_plan_on_a_cuda_device_and_the_reasons_not_to_capture(caplog):
    model = torch.nn.Linear(2, 2)
    cuda = torch.device("cuda")
    config = EngineConfig(compilation=CompilationConfig(cuda_graph_sizes=(32,)))
    plan = plan_decode_graphs(config, cuda, model, "triton", max_model_len=2048)
    assert plan == DecodeGraphPlan((1, 2, 4, 8, 16, 24, 32), 2048)  # 8192 capped at the model's
    assert plan_decode_graphs(config, torch.device("cpu"), model, "torch", 2048) is None
    reasons = {
        "--enforce-eager": dict(enforce_eager=True),
        "--enable-lora (a step's adapters are chosen per row on the host)": dict(lora_enabled=True),
        "--tensor-parallel-size 2": dict(tensor_parallel_size=2),
    }
    base = dict(enforce_eager=False, lora_enabled=False, tensor_parallel_size=1)
    for reason, change in reasons.items():
        assert why_not_captured(model, "triton", **{**base, **change}) == reason
    assert why_not_captured(model, "torch", **base).startswith("--attention-backend torch")
    assert why_not_captured(model, "triton", **base) is None
    encoder = torch.nn.Linear(2, 2)
    encoder.uses_kv_cache = False
    assert why_not_captured(encoder, "triton", **base) == "an encoder's steps are not decodes"
    config = EngineConfig(
        lora=LoRAConfig(enabled=True), parallel=ParallelConfig(), compilation=CompilationConfig()
    )
    with caplog.at_level(logging.WARNING, logger="llmrpc.engine.runner.cuda_graphs"):
        assert plan_decode_graphs(config, cuda, model, "triton", 2048) is None
    assert _graph_logs(caplog) == [
        "decode steps run eager, not as CUDA graphs: --enable-lora (a step's adapters are "
        "chosen per row on the host)"
    ]


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("cuda_graph_sizes", (8, 0), "--cuda-graph-sizes: each size must be positive, got 0"),
        ("cuda_graph_sizes", (-4,), "--cuda-graph-sizes: each size must be positive, got -4"),
        ("max_seq_len_to_capture", 0, "--max-seq-len-to-capture must be positive, got 0"),
    ],
)
def test_bad_values_name_the_flag(field, value, message):
    with pytest.raises(ValueError, match=message):
        CompilationConfig(**{field: value})


def _serve(*argv: str) -> EngineConfig:
    parser = OneLineErrorParser(add_help=False)
    options.add_serve_arguments(parser)
    return options.build_configs(options.parse_serve_values(parser, list(argv)))[0]


def test_flags_reach_the_config_and_are_refused_on_the_cpu():
    engine = _serve("--cuda-graph-sizes", "1", "2", "128", "--max-seq-len-to-capture", "4096")
    assert engine.compilation.cuda_graph_sizes == (1, 2, 128)
    assert engine.compilation.capture_len == 4096
    defaults = _serve("--device", "cpu").compilation
    assert (defaults.cuda_graph_sizes, defaults.capture_len) == ((), 8192)
    for flag, value in (("--cuda-graph-sizes", "8"), ("--max-seq-len-to-capture", "8192")):
        with pytest.raises(ValueError) as refusal:
            _serve("--device", "cpu", flag, value)
        assert str(refusal.value) == (
            f"{flag} sizes CUDA graphs, which are captured on a CUDA device only; the engine "
            "runs on the CPU here (--device cpu, or auto where no CUDA device is visible): "
            "leave it out"
        )


@pytest.mark.skipif(torch.cuda.is_available(), reason="auto picks the CUDA device here")
def test_auto_on_a_cpu_machine_refuses_a_given_graph_flag_before_loading(tiny_llama_dir):
    with pytest.raises(ValueError, match="^--max-seq-len-to-capture sizes CUDA graphs"):
        make_core(
            tiny_llama_dir,
            device="auto",
            compilation=CompilationConfig(max_seq_len_to_capture=1024),
        )
    make_core(tiny_llama_dir, device="auto")  # the defaults pass
