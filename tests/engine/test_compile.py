"""-O1..3: the decode step compiled with torch.compile gives eager's tokens and logprobs, in one
graph for every batch size, compiled at load; a compile or a compiled step that fails is logged
once and the engine runs eager."""

from __future__ import annotations

import logging
import os

import msgspec
import pytest
import torch
from attention_plans import forced_choice
from engine_utils import make_core, run_to_completion

from llmrpc.engine.config import CacheConfig, CompilationConfig, EngineConfig, ModelConfig
from llmrpc.engine.core.engine_core import EngineCore
from llmrpc.engine.models.llama import LlamaDecoderLayer
from llmrpc.engine.quantization.layers import QuantizedLinear
from llmrpc.engine.request import SamplingParams
from llmrpc.engine.runner import compilation
from llmrpc.kernels import attention_tuning

COMPILED = CompilationConfig({"level": 3})
TOP = 5
# inductor's own kernels (the embedding, rotary's cos and sin) may round differently from eager's
# (seen: float32 1e-6, bfloat16 equal)
TOLERANCE = 1e-4


def _params(max_tokens: int, **more) -> SamplingParams:
    return SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=TOP, **more
    )


def run_mixed_workload(core) -> tuple[dict, int]:
    """Decodes, then one step that adds a long prompt (a prefill: eager), a prompt with a prefix
    hit and a short prompt to them, then decodes-only steps from batch 4 down to 1. Returns
    request id -> its tokens with their top logprobs (and "short"'s prompt logprobs), and the
    number of steps."""
    first = list(range(300, 340))  # 40 tokens: two full blocks the "hit" prompt reuses
    core.add_request("decode", first, _params(30))
    steps = [core.step() for _ in range(3)]
    core.add_request("long", list(range(1000, 1300)), _params(20))  # 300 tokens of context
    core.add_request("hit", first[:32] + list(range(700, 710)), _params(12))
    core.add_request("short", [5, 6, 7, 8, 9], _params(6, prompt_logprobs=TOP))
    while core.has_unfinished_requests:
        steps.append(core.step())
    results: dict = {}
    for outputs in steps:
        for out in outputs:
            entry = results.setdefault(out.request_id, {"tokens": [], "cached": 0})
            entry["tokens"] += [(lp.token_id, lp.top) for lp in out.logprobs]
            entry["cached"] = max(entry["cached"], out.num_cached_tokens)
            if out.prompt_logprobs:
                entry["prompt"] = out.prompt_logprobs
    return results, len(steps)


def assert_same_outputs(got: dict, expected: dict, tolerance: float) -> None:
    assert got.keys() == expected.keys()
    for request_id, entry in expected.items():
        tokens = [token_id for token_id, _ in got[request_id]["tokens"]]
        assert tokens == [token_id for token_id, _ in entry["tokens"]], request_id
        pairs = zip(got[request_id]["tokens"], entry["tokens"], strict=True)
        for (_, top), (_, expected_top) in pairs:
            assert [t for t, _ in top] == [t for t, _ in expected_top], request_id
            values = torch.tensor([v for _, v in top])
            expected_values = torch.tensor([v for _, v in expected_top])
            torch.testing.assert_close(values, expected_values, atol=tolerance, rtol=0)
    assert got["short"]["prompt"] == expected["short"]["prompt"]  # eager, in the mixed step


# decode rows on the C++ decode kernel, the compiled step's, whatever a busy machine's timing said
pytestmark = pytest.mark.usefixtures("cpp_decode_attention")


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def dtype(request):
    return request.param


@pytest.fixture(scope="module")
def eager_outputs(tiny_llama_dir, dtype):
    outputs, _ = run_mixed_workload(make_core(tiny_llama_dir, dtype))
    assert outputs["hit"]["cached"] == 32
    return outputs


def warnings_of_ours(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("llmrpc") and r.levelno >= logging.WARNING
    ]


def count_compiled_calls(core, monkeypatch) -> list[int]:
    calls = [0]
    compiled_forward = core.runner.compiled_decode._forward

    def counting(*args):
        calls[0] += 1
        return compiled_forward(*args)

    monkeypatch.setattr(core.runner.compiled_decode, "_forward", counting)
    return calls


def test_compiled_decode_steps_give_eager_tokens_and_logprobs(
    tiny_llama_dir, dtype, eager_outputs, monkeypatch
):
    core = make_core(tiny_llama_dir, dtype, compilation=COMPILED)
    compiled = core.runner.compiled_decode
    assert compiled is not None and compiled.failure is None  # compiled at load
    calls = count_compiled_calls(core, monkeypatch)
    outputs, num_steps = run_mixed_workload(core)
    assert_same_outputs(outputs, eager_outputs, TOLERANCE)
    # Batches of 1 to 4 rows, contexts of 5 to 320 tokens, a prompt as rows of the decode kernel:
    # all ran the graph compiled at load (a new compile would have raised and ended it)...
    assert compiled.failure is None
    assert calls[0] == num_steps - 1  # ... but the step with the 300-token prefill, eager


@pytest.mark.parametrize("dtype", ["float32"], indirect=True)
def test_steps_past_the_rows_planned_for_the_decode_kernel_run_eager(
    tiny_llama_dir, dtype, eager_outputs, monkeypatch
):
    """Where torch's path was timed faster for decode steps past 32 rows, the compiled step,
    which holds the C++ kernel, takes steps of up to 32: the first step (a 40-token prompt as
    rows of the decode kernel) runs eager, on torch's path, every other decodes-only step
    compiled, and the tokens are eager's."""
    torch_past_32 = forced_choice("decode", ("cpp-decode",) * 3 + ("torch-sdpa",) * 3)
    monkeypatch.setattr(attention_tuning, "choose", torch_past_32)
    core = make_core(tiny_llama_dir, dtype, compilation=COMPILED)
    compiled = core.runner.compiled_decode
    assert compiled is not None and compiled.failure is None and compiled.max_rows == 32
    calls = count_compiled_calls(core, monkeypatch)
    outputs, num_steps = run_mixed_workload(core)
    assert_same_outputs(outputs, eager_outputs, TOLERANCE)
    assert compiled.failure is None
    assert calls[0] == num_steps - 2  # the 40-row step and the 300-token prefill's, eager


def test_the_cpu_graph_takes_the_step_sizes_as_its_only_int_arguments(tiny_llama_dir, monkeypatch):
    """Each size the graph leaves dynamic is an int argument, which inductor's C++ wrapper makes
    into a tensor on every call: on the CPU the KV caches' sizes are static, and the ints are
    the step's own sizes (tokens, positions, slots, block table, context lengths)."""
    from torch._inductor import compile_fx

    int_inputs = []
    real = compile_fx.compile_fx

    def recording(graph, example_inputs, *args, **kwargs):
        int_inputs.append([x for x in example_inputs if isinstance(x, torch.SymInt)])
        return real(graph, example_inputs, *args, **kwargs)

    monkeypatch.setattr(compile_fx, "compile_fx", recording)
    core = make_core(tiny_llama_dir, "float32", compilation=COMPILED)
    assert core.runner.compiled_decode.failure is None
    assert int_inputs  # compile_fx calls itself with the options applied: one list a call
    for ints in int_inputs:
        names = sorted(str(size) for size in ints)
        assert len(names) == 6 and all(name.startswith("u") for name in names), names  # unbacked


def test_speculative_verify_steps_run_the_compiled_graph(tiny_llama_dir, monkeypatch):
    """A step of decodes and their drafts is decode rows only: the graph compiled at load runs
    it (no new compile, no fall-back), and greedy float32 tokens are those without drafts."""
    from llmrpc.engine.spec_decode.config import SpeculativeConfig
    from llmrpc.engine.spec_decode.ngram import NgramProposer

    core = make_core(tiny_llama_dir, "float32", compilation=COMPILED)
    prompt = [(5 * j) % 300 + 20 for j in range(40)] * 2  # lookups find what follows
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    requests = {f"r{i}": (prompt[i:], params) for i in range(3)}
    plain = run_to_completion(core, requests)
    proposer = NgramProposer(SpeculativeConfig({"method": "ngram", "num_speculative_tokens": 3,
                                                "prompt_lookup_min": 1}))  # fmt: skip
    proposer.cost.row_share = lambda batch: 0.0  # every draft proposed, whatever steps cost
    core.proposer = core.scheduler.proposer = proposer
    rows, compiled_forward = [], core.runner.compiled_decode._forward

    def counting(input_ids, *args):
        rows.append(len(input_ids))
        return compiled_forward(input_ids, *args)

    monkeypatch.setattr(core.runner.compiled_decode, "_forward", counting)
    spec = run_to_completion(core, requests)
    assert proposer.stats.num_accepted_tokens > 0
    assert {k: o.token_ids for k, o in spec.items()} == {k: o.token_ids for k, o in plain.items()}
    assert max(rows) > 3  # a verify step (3 requests, drafts as rows) ran compiled
    assert core.runner.compiled_decode.failure is None


@pytest.mark.parametrize("dtype", ["bfloat16"], indirect=True)  # the CPU's serving dtype
def test_a_compiled_engine_gives_the_idle_core_to_its_kernels_alone(
    tiny_llama_dir, dtype, eager_outputs, monkeypatch
):
    """torch.compile guards the graph on torch's thread count: a change would end the compiled
    step. So a compiled engine's budget moves its own kernels' count (linear layers, decode
    attention) and leaves torch's as it was: the steps run the graph compiled at load, on two
    threads for the kernels while the rest of the machine is idle, and give eager's tokens."""
    from llmrpc.engine.runner.threads import ThreadBudget
    from llmrpc.kernels import cpu_ops

    if not cpu_ops.load():
        pytest.skip("the CPU kernels are not built here")
    clock = {"now": 100.0, "own": 40.0}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the count the graph is compiled for
    core = make_core(tiny_llama_dir, dtype, compilation=COMPILED)
    monkeypatch.setattr(
        "llmrpc.engine.core.engine_core.idle_core_budget",
        lambda: ThreadBudget(2, clock=lambda: clock["now"], machine=lambda: 5000.0 + clock["own"],
                             own=lambda: clock["own"]),
    )  # fmt: skip
    calls = count_compiled_calls(core, monkeypatch)
    try:
        assert core.use_idle_cores()
        core.add_request("warm", [5, 6, 7], _params(3))
        run_to_completion(core, {})
        assert torch.ops.llmrpc_cpu.kernel_team_size() == 1  # nothing measured yet: one thread
        clock["now"] += 0.3
        clock["own"] += 0.3  # the rest of the machine idle since the last check
        outputs, num_steps = run_mixed_workload(core)
        assert torch.ops.llmrpc_cpu.kernel_team_size() == 2
        assert torch.get_num_threads() == 1
    finally:
        cpu_ops.set_kernel_threads(0)
        torch.set_num_threads(threads)
    assert_same_outputs(outputs, eager_outputs, TOLERANCE)
    assert core.runner.compiled_decode.failure is None
    assert calls[0] >= num_steps - 1  # every decode step ran the graph compiled at load


def test_a_compile_that_fails_is_logged_once_and_the_engine_runs_eager(
    tiny_llama_dir, eager_outputs, dtype, monkeypatch, caplog
):
    original = LlamaDecoderLayer.forward

    def breaking_forward(self, *args):
        torch._dynamo.graph_break()  # a no-op in eager; compiling with fullgraph=True fails
        return original(self, *args)

    monkeypatch.setattr(LlamaDecoderLayer, "forward", breaking_forward)
    with caplog.at_level(logging.WARNING, logger="llmrpc.engine.runner.compilation"):
        core = make_core(tiny_llama_dir, dtype, compilation=COMPILED)
        outputs, _ = run_mixed_workload(core)
    assert core.runner.compiled_decode is None
    warnings = warnings_of_ours(caplog)
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("the compiled decode step failed, decode steps run eager")
    assert_same_outputs(outputs, eager_outputs, 0.0)


def test_a_compiled_step_that_fails_runs_again_eager(
    tiny_llama_dir, eager_outputs, dtype, monkeypatch, caplog
):
    core = make_core(tiny_llama_dir, dtype, compilation=COMPILED)
    compiled = core.runner.compiled_decode
    calls = count_compiled_calls(core, monkeypatch)
    counting = compiled._forward

    def failing_on_the_fifth(*args):
        if calls[0] == 4:
            raise RuntimeError("compiled step broke")
        return counting(*args)

    monkeypatch.setattr(compiled, "_forward", failing_on_the_fifth)
    with caplog.at_level(logging.WARNING, logger="llmrpc.engine.runner.compilation"):
        outputs, _ = run_mixed_workload(core)
    assert calls[0] == 4  # none after the failure
    assert compiled.failure == "RuntimeError: compiled step broke"
    assert warnings_of_ours(caplog) == [
        "the compiled decode step failed, decode steps run eager from now on (unless the device "
        "faulted: CUDA's error is sticky, every later step fails): "
        "RuntimeError: compiled step broke"
    ]
    assert_same_outputs(outputs, eager_outputs, TOLERANCE)


def test_sleep_and_wake_up_keep_the_compiled_step(tiny_llama_dir, dtype, eager_outputs):
    core = EngineCore(
        EngineConfig(
            model=ModelConfig(
                model=str(tiny_llama_dir), dtype=dtype, max_model_len=512, enable_sleep_mode=True
            ),
            cache=CacheConfig(num_gpu_blocks_override=256),
            compilation=COMPILED,
        )
    )
    compiled = core.runner.compiled_decode
    core.sleep(1)  # the KV cache is freed, and made anew on waking: the same graph takes it
    core.wake_up()
    assert core.runner.compiled_decode is compiled
    core.sleep(2)  # the weights too: the compiled forward, which holds them, goes with them
    assert core.runner.compiled_decode is None
    core.wake_up()
    assert core.runner.compiled_decode not in (None, compiled)
    outputs, _ = run_mixed_workload(core)
    assert core.runner.compiled_decode.failure is None
    assert_same_outputs(outputs, eager_outputs, TOLERANCE)


def _quantized_core(model_dir, method: str, compiled: bool) -> EngineCore:
    return EngineCore(
        EngineConfig(
            model=ModelConfig(
                model=str(model_dir), dtype="bfloat16", max_model_len=512, quantization=method
            ),
            cache=CacheConfig(num_gpu_blocks_override=256),
            compilation=COMPILED if compiled else CompilationConfig(),
        )
    )


@pytest.mark.parametrize("method", ["int4", "int8"])
def test_quantized_models_compile_their_packed_kernels(tiny_llama_dir, method, monkeypatch):
    """The graph holds the packed kernels' branch, so it runs only steps with at most as many
    rows as every quantized layer computes with its packed kernel (measured at load: the
    fewest of the layers' dense_above); a decodes-only step of more rows runs eager."""
    eager, _ = run_mixed_workload(_quantized_core(tiny_llama_dir, method, compiled=False))
    core = _quantized_core(tiny_llama_dir, method, compiled=True)
    compiled = core.runner.compiled_decode
    assert compiled is not None and compiled.failure is None
    model = core.runner.model
    limit = min(m.dense_above for m in model.modules() if isinstance(m, QuantizedLinear))
    assert compiled.max_rows == limit
    calls = count_compiled_calls(core, monkeypatch)
    rows = []  # the rows of each decodes-only step
    entry = type(compiled).__call__
    monkeypatch.setattr(
        type(compiled),
        "__call__",
        lambda self, *args: rows.append(len(args[0])) or entry(self, *args),
    )
    outputs, num_steps = run_mixed_workload(core)
    assert_same_outputs(outputs, eager, TOLERANCE)
    assert len(rows) == num_steps - 1  # all but the step with the 300-token prefill
    # a decodes-only step of more rows than that runs eager (its layers past dense_above
    # dequantize): a prompt of limit + 8 fresh tokens, each a row of the decode path (up to 256)
    if limit + 8 <= 256:
        core.add_request("rows", list(range(2000, 2000 + limit + 8)), _params(1))
        core.step()
        assert rows[-1] == limit + 8 and calls[0] < len(rows)
    assert compiled.failure is None
    assert calls[0] == len([count for count in rows if count <= limit])


def test_enforce_eager_overrides_the_level_with_a_warning(tiny_llama_dir, caplog):
    with caplog.at_level(logging.WARNING):
        core = make_core(
            tiny_llama_dir, compilation=CompilationConfig({"level": 3}, enforce_eager=True)
        )
    assert core.runner.compiled_decode is None
    assert warnings_of_ours(caplog) == [
        "--enforce-eager overrides --compilation-config level 3: the engine runs eager"
    ]


def test_the_level_reaches_the_engine_process():
    config = EngineConfig(compilation=CompilationConfig({"mode": 2}, enforce_eager=True))
    startup = msgspec.msgpack.decode(msgspec.msgpack.encode(config), type=EngineConfig)
    assert startup.compilation == config.compilation and startup.compilation.level == 0


def test_level_0_compiles_nothing(tiny_llama_dir):
    core = make_core(tiny_llama_dir, compilation=CompilationConfig({"level": 0}))
    assert core.runner.compiled_decode is None


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, "{home}/.cache/llmrpc/inductor"),
        ({"LLMRPC_CACHE_DIR": "/srv/cache"}, "/srv/cache/inductor"),
        ({"TORCHINDUCTOR_CACHE_DIR": "{torch_default}"}, "{home}/.cache/llmrpc/inductor"),
        ({"TORCHINDUCTOR_CACHE_DIR": "/srv/inductor"}, "/srv/inductor"),
    ],
)
def test_the_inductor_cache_outlives_a_restart(monkeypatch, tmp_path, environ, expected):
    """Under the user's cache folder unless set elsewhere; torch's own default, which importing
    torch._dynamo puts in the environment, is under /tmp."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    names = {"home": str(tmp_path), "torch_default": default_cache_dir()}
    monkeypatch.setenv("HOME", str(tmp_path))
    for name in ("LLMRPC_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value.format(**names))
    folder = compilation.inductor_cache_dir()
    assert str(folder) == expected.format(**names)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(folder)  # where inductor reads it


def test_a_torch_compile_without_isolate_recompiles_still_compiles(monkeypatch):
    # torch 2.11 (the GPU machine's) has no isolate_recompiles: it must not be passed there.
    received = {}

    def old_compile(model, *, fullgraph=False, options=None):
        received.update(fullgraph=fullgraph, options=options)
        return model

    monkeypatch.setattr(torch, "compile", old_compile)
    compiled = compilation.CompiledDecode(torch.nn.Linear(2, 2), "torch")
    assert compiled.failure is None and compiled._forward is not None
    assert received["fullgraph"] is True and received["options"]["cpp_wrapper"] is True


def test_a_compile_that_cannot_be_built_logs_one_line_and_runs_eager(monkeypatch, caplog):
    def unbuildable(model, **kwargs):
        raise TypeError("compile() got an unexpected keyword argument 'isolate_recompiles'")

    monkeypatch.setattr(torch, "compile", unbuildable)
    with caplog.at_level(logging.WARNING, logger="llmrpc.engine.runner.compilation"):
        compiled = compilation.CompiledDecode(torch.nn.Linear(2, 2), "torch")
        assert compiled(None, None, None, None) is None  # this step, and every one, eager
    assert compiled.failure.startswith("TypeError: compile() got an unexpected keyword")
    assert len(warnings_of_ours(caplog)) == 1
