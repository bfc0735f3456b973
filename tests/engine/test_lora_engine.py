"""LoRA in the engine: in a batch that mixes adapters and the base model, each request gets the
greedy tokens of PEFT's merged model of its adapter (float32, token for token), whatever slot its
adapter has and whichever requests run beside it."""

from __future__ import annotations

import pytest
from engine_utils import greedy_generate, hf_greedy, run_to_completion
from lora_adapters import AdapterSpec, make_adapter
from tiny_models import TINY_DECODER, save_tiny_model

from llmrpc.engine.config import CacheConfig, EngineConfig, ModelConfig
from llmrpc.engine.core.engine_core import EngineCore
from llmrpc.engine.core_types import EngineStateError
from llmrpc.engine.lora import layers as lora_layers
from llmrpc.engine.lora.types import (
    LoRAAdapterExistsError,
    LoRAAdapterNotFoundError,
    LoRAConfig,
    LoRAModulePath,
)
from llmrpc.engine.request import InvalidRequestError, SamplingParams
from llmrpc.engine.spec_decode.config import SpeculativeConfig
from llmrpc.engine.spec_decode.ngram import NgramProposer

MAX_TOKENS = 8
PROMPT_TEXTS = ["Hi", "What is the capital of France?", "def fibonacci(n):", "1, 2, 3, 4,"]
# different ranks, alphas and targets; one rsLoRA; one only on the fused qkv's q and v slices
ADAPTERS = {
    "all-r8": AdapterSpec(rank=8, alpha=16, seed=1),
    "qv-r4-rslora": AdapterSpec(
        rank=4, alpha=8, targets=("q_proj", "v_proj"), use_rslora=True, seed=2
    ),
    "mlp-o-r16": AdapterSpec(
        rank=16, alpha=8, targets=("o_proj", "gate_proj", "up_proj", "down_proj"), seed=3
    ),
}


def lora_core(model_dir, adapters: dict, attention_backend="torch", **lora) -> EngineCore:
    modules = tuple(LoRAModulePath(name, str(path)) for name, path in adapters.items())
    return EngineCore(
        EngineConfig(
            model=ModelConfig(
                model=str(model_dir),
                dtype="float32",
                max_model_len=256,
                device="cpu",
                attention_backend=attention_backend,
            ),
            cache=CacheConfig(num_gpu_blocks_override=128),
            lora=LoRAConfig(enabled=True, lora_modules=modules, **lora),
        )
    )


@pytest.fixture(scope="module")
def prompts(tiny_llama_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    return [tokenizer.encode(text) for text in PROMPT_TEXTS]


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory, prompts):
    """name -> (folder, the merged model's greedy tokens for each prompt); "" is the base."""
    made = {"": (None, hf_greedy(tiny_llama_dir, prompts, MAX_TOKENS))}
    for name, spec in ADAPTERS.items():
        folder = tmp_path_factory.mktemp(name)
        merged = make_adapter(tiny_llama_dir, folder, spec)
        made[name] = (folder, greedy_generate(merged, prompts, MAX_TOKENS))
    return made


@pytest.fixture(scope="module")
def core(tiny_llama_dir, adapters):
    folders = {name: folder for name, (folder, _) in adapters.items() if name}
    return lora_core(tiny_llama_dir, folders, max_loras=3)


def _requests(prompts, names):
    return {
        f"{name or 'base'}-{index}": (
            prompt,
            SamplingParams(
                temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, lora_name=name or None
            ),
        )
        for name in names
        for index, prompt in enumerate(prompts)
    }


def _check_tokens(outputs, adapters, names, num_prompts):
    for name in names:
        expected = adapters[name][1]
        got = [outputs[f"{name or 'base'}-{i}"].token_ids for i in range(num_prompts)]
        assert got == expected, name


@pytest.mark.parametrize("dense_max_rows", [0, 10**6], ids=["segmented", "dense"])
def test_mixed_batch_matches_peft_merged_models(
    core, adapters, prompts, monkeypatch, dense_max_rows
):
    """Both CPU paths: the segmented kernels' twin, and one masked matmul over all slots."""
    monkeypatch.setattr(lora_layers, "DENSE_MAX_ROWS", dense_max_rows)
    names = ["", *ADAPTERS]
    outputs = run_to_completion(core, _requests(prompts, names))
    _check_tokens(outputs, adapters, names, len(prompts))
    for name in ADAPTERS:  # each adapter matters: its tokens are not the base model's
        assert adapters[name][1] != adapters[""][1], name


def test_triton_kernels_match_peft_merged_models(tiny_llama_dir, adapters, prompts):
    """--attention-backend triton: the segmented Triton LoRA kernels in every step (interpreted
    on the CPU, as tests/conftest.py sets it without a GPU)."""
    folders = {name: adapters[name][0] for name in ADAPTERS}
    core = lora_core(tiny_llama_dir, folders, attention_backend="triton", max_loras=3)
    assert not core.lora.context.dense_allowed
    names = ["", *ADAPTERS]
    outputs = run_to_completion(core, _requests(prompts[:2], names))
    for name in names:
        got = [outputs[f"{name or 'base'}-{i}"].token_ids for i in range(2)]
        assert got == adapters[name][1][:2], name


def test_adapters_beyond_the_slots_wait_and_base_requests_pass(tiny_llama_dir, adapters, prompts):
    folders = {name: adapters[name][0] for name in ADAPTERS}
    core = lora_core(tiny_llama_dir, folders, max_loras=1, max_cpu_loras=2)
    names = [*ADAPTERS, ""]  # the base model's requests queue behind all the adapters'
    for request_id, (prompt, params) in _requests(prompts, names).items():
        core.add_request(request_id, prompt, params)
    merged, first_step = {}, True
    while core.has_unfinished_requests:
        outputs = core.step()
        running = core.scheduler.running
        assert len({r.lora.lora_id for r in running if r.lora is not None}) <= 1
        if first_step:  # the base model's requests did not wait behind the other adapters
            assert sum(r.lora is None for r in running) == len(prompts)
            first_step = False
        for output in outputs:
            if output.request_id in merged:
                merged[output.request_id].merge(output)
            else:
                merged[output.request_id] = output
    _check_tokens(merged, adapters, names, len(prompts))


def test_unloaded_adapter_finishes_its_running_requests(core, adapters, prompts):
    folder, expected = adapters["all-r8"]
    core.load_lora_adapter("again", str(folder))
    params = SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, lora_name="again"
    )
    core.add_request("running", prompts[1], params)
    tokens = [t for _ in range(2) for output in core.step() for t in output.token_ids]
    core.unload_lora_adapter("again")  # while its request runs
    with pytest.raises(LoRAAdapterNotFoundError):
        core.add_request("late", prompts[1], params)
    tokens += run_to_completion(core, {})["running"].token_ids
    assert tokens == expected[1]
    assert "again" not in {entry["name"] for entry in core.list_lora_adapters()}


def test_load_errors(core, adapters, tmp_path, tiny_llama_dir):
    folder = adapters["all-r8"][0]
    with pytest.raises(LoRAAdapterExistsError):
        core.load_lora_adapter("qv-r4-rslora", str(folder))
    with pytest.raises(InvalidRequestError, match="not a loadable LoRA adapter folder") as error:
        core.load_lora_adapter("missing", str(tmp_path / "nowhere"))
    assert error.value.field == "lora_path"
    big = tmp_path / "r32"
    make_adapter(tiny_llama_dir, big, AdapterSpec(rank=32, alpha=32))
    with pytest.raises(InvalidRequestError, match="rank 32 is over --max-lora-rank 16"):
        core.load_lora_adapter("big", str(big))
    dora = tmp_path / "dora"
    make_adapter(tiny_llama_dir, dora, AdapterSpec(rank=4, alpha=8, extra={"use_dora": True}))
    with pytest.raises(InvalidRequestError, match="DoRA"):
        core.load_lora_adapter("dora", str(dora))
    with pytest.raises(LoRAAdapterNotFoundError):
        core.unload_lora_adapter("never-loaded")
    with pytest.raises(LoRAAdapterNotFoundError):
        core.add_request("x", [1, 2, 3], SamplingParams(lora_name="never-loaded"))
    names = {entry["name"] for entry in core.list_lora_adapters()}
    assert names == set(ADAPTERS)  # the refused ones were not added


def test_lora_off_refuses_adapters(tiny_llama_dir):
    from engine_utils import make_core

    core = make_core(tiny_llama_dir)
    with pytest.raises(LoRAAdapterNotFoundError, match="--enable-lora"):
        core.add_request("x", [1, 2, 3], SamplingParams(lora_name="any"))
    with pytest.raises(EngineStateError, match="--enable-lora"):
        core.load_lora_adapter("any", "/nowhere")
    assert core.list_lora_adapters() == []


# PEFT takes lora_B's 1-D bias for an unsaved shard (a false alarm for a bias)
@pytest.mark.filterwarnings("ignore:Adapter 'default'")
def test_lora_bias_needs_the_flag_and_matches_peft(tmp_path, smollm2_dir, prompts):
    """PEFT's lora_bias (a bias on lora_B, scaled with it) on Qwen2's biased q/k/v projections:
    refused without --enable-lora-bias, PEFT's tokens with it, on both CPU paths."""
    base = save_tiny_model(
        tmp_path / "qwen2", smollm2_dir, "qwen2", randomize_biases_and_norms=True, **TINY_DECODER
    )
    spec = AdapterSpec(8, 16, ("q_proj", "k_proj", "v_proj"), seed=4, extra={"lora_bias": True})
    merged = make_adapter(base, tmp_path / "biased", spec)
    expected = greedy_generate(merged, prompts[:2], MAX_TOKENS)
    with pytest.raises(InvalidRequestError, match="--enable-lora-bias"):
        lora_core(base, {"biased": tmp_path / "biased"})
    core = lora_core(base, {"biased": tmp_path / "biased"}, enable_lora_bias=True)
    for dense_max_rows in (0, 10**6):
        lora_layers.DENSE_MAX_ROWS, saved = dense_max_rows, lora_layers.DENSE_MAX_ROWS
        try:
            requests = _requests(prompts[:2], ["biased"])
            outputs = run_to_completion(
                core, {f"{k}-{dense_max_rows}": v for k, v in requests.items()}
            )
        finally:
            lora_layers.DENSE_MAX_ROWS = saved
        got = [outputs[f"biased-{i}-{dense_max_rows}"].token_ids for i in range(2)]
        assert got == expected, dense_max_rows


@pytest.mark.parametrize("model_type", ["gemma3_text", "gemma2"])
def test_gemma_adapters_match_peft(tmp_path, smollm2_dir, prompts, model_type):
    """Gemma's layers (four norms, GELU-tanh MLP, local and global attention; Gemma 2's scores
    capped at 0.05) with an adapter on every projection: PEFT's merged model's tokens."""
    config = {**TINY_DECODER, "head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 8,
              "layer_types": ["sliding_attention", "full_attention"]}  # fmt: skip
    if model_type == "gemma2":
        config["attn_logit_softcapping"] = 0.05
    base = save_tiny_model(tmp_path / "gemma", smollm2_dir, model_type,
                           randomize_biases_and_norms=True, **config)  # fmt: skip
    merged = make_adapter(base, tmp_path / "adapter", AdapterSpec(8, 16, seed=6))
    expected = greedy_generate(merged, prompts, MAX_TOKENS)
    assert expected != hf_greedy(base, prompts, MAX_TOKENS)  # the adapter changes the tokens
    core = lora_core(base, {"gemma": tmp_path / "adapter"})
    outputs = run_to_completion(core, _requests(prompts, ["gemma"]))
    assert [outputs[f"gemma-{i}"].token_ids for i in range(len(prompts))] == expected


def test_adapters_of_a_fused_checkpoint_match_peft(tmp_path, smollm2_dir, prompts):
    """Phi-3's checkpoint fuses q/k/v and gate/up, so its adapters target qkv_proj and
    gate_up_proj (one lora_A, the slices' B stacked): PEFT's merged model's tokens, on both
    CPU paths; an adapter of both a fused module and one of its slices is refused."""
    base = save_tiny_model(tmp_path / "phi3", smollm2_dir, "phi3", randomize_biases_and_norms=True,
                           **TINY_DECODER)  # fmt: skip
    spec = AdapterSpec(8, 16, ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"), seed=5)
    merged = make_adapter(base, tmp_path / "fused", spec)
    expected = greedy_generate(merged, prompts, MAX_TOKENS)
    assert expected != hf_greedy(base, prompts, MAX_TOKENS)  # the adapter changes the tokens
    core = lora_core(base, {"fused": tmp_path / "fused"})
    for dense_max_rows in (0, 10**6):
        lora_layers.DENSE_MAX_ROWS, saved = dense_max_rows, lora_layers.DENSE_MAX_ROWS
        try:
            requests = _requests(prompts, ["fused"])
            outputs = run_to_completion(
                core, {f"{k}-{dense_max_rows}": v for k, v in requests.items()}
            )
        finally:
            lora_layers.DENSE_MAX_ROWS = saved
        got = [outputs[f"fused-{i}-{dense_max_rows}"].token_ids for i in range(len(prompts))]
        assert got == expected, dense_max_rows
    from safetensors.torch import load_file, save_file

    weights = load_file(tmp_path / "fused" / "adapter_model.safetensors")
    fused_a = next(k for k in weights if "layers.0.self_attn.qkv_proj.lora_A" in k)
    weights[fused_a.replace("qkv_proj", "q_proj")] = weights[fused_a].clone()
    save_file(weights, tmp_path / "fused" / "adapter_model.safetensors")
    with pytest.raises(InvalidRequestError, match="both qkv_proj and its slice q_proj"):
        core.load_lora_adapter("both", str(tmp_path / "fused"))


@pytest.mark.parametrize("dense_max_rows", [0, 10**6], ids=["segmented", "dense"])
def test_speculative_drafts_take_their_requests_adapters(
    core, adapters, prompts, monkeypatch, dense_max_rows
):
    """--speculative-config with LoRA: a request's draft rows run its adapter, as its own row
    does (the tokens are each merged model's, token for token)."""
    monkeypatch.setattr(lora_layers, "DENSE_MAX_ROWS", dense_max_rows)
    config = SpeculativeConfig({"method": "ngram", "num_speculative_tokens": 3,
                                "prompt_lookup_min": 1})  # fmt: skip
    proposer = NgramProposer(config)
    proposer.cost.row_share = lambda batch: 0.0  # every draft proposed, whatever steps cost
    core.proposer = core.scheduler.proposer = proposer
    try:
        names = ["", *ADAPTERS]
        outputs = run_to_completion(core, _requests(prompts, names))
    finally:
        core.proposer = core.scheduler.proposer = None
    assert proposer.stats.num_accepted_tokens > 0
    _check_tokens(outputs, adapters, names, len(prompts))


def test_moe_adapters_on_attention_match_peft_and_expert_targets_are_refused(
    tmp_path, smollm2_dir, prompts
):
    """On a MoE model (Qwen2-MoE: a dense layer, then experts and a shared expert) LoRA adapts
    the attention projections: PEFT's merged model's tokens. An adapter of an MLP projection is
    refused, naming it, when it is loaded (PEFT put one on the shared expert's down_proj)."""
    from tiny_models import save_moe

    base = save_moe(tmp_path / "moe", smollm2_dir, "qwen2_moe")
    spec = AdapterSpec(8, 16, ("q_proj", "k_proj", "v_proj", "o_proj"), seed=7)
    merged = make_adapter(base, tmp_path / "attention", spec)
    expected = greedy_generate(merged, prompts, MAX_TOKENS)
    assert expected != hf_greedy(base, prompts, MAX_TOKENS)  # the adapter changes the tokens
    core = lora_core(base, {"attention": tmp_path / "attention"})
    outputs = run_to_completion(core, _requests(prompts, ["attention"]))
    assert [outputs[f"attention-{i}"].token_ids for i in range(len(prompts))] == expected
    make_adapter(base, tmp_path / "mlp", AdapterSpec(4, 8, ("q_proj", "down_proj"), seed=8))
    with pytest.raises(
        InvalidRequestError,
        match=r"down_proj.*\(only q_proj, k_proj, v_proj, o_proj, qkv_proj of the decoder "
        "layers; a MoE",
    ):
        core.load_lora_adapter("mlp", str(tmp_path / "mlp"))
