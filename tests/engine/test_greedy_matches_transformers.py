"""The correctness oracle: greedy output equals Transformers' token for token, in any batch."""

from __future__ import annotations

import dataclasses

import pytest
from engine_utils import greedy_generate, hf_greedy, make_core, run_to_completion
from tiny_models import TINY_DECODER, save_tiny_model

from llmrpc.engine.request import SamplingParams

PROMPT_TEXTS = [
    "Hi",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Explain gravity to a child in two sentences, please.",
    "1, 2, 3, 4, 5,",
    "Once upon a time, in a small village by the mountains, there lived an old clockmaker "
    "who had never once left his workshop. One morning, a letter arrived",
    "def fibonacci(n):",
]


def _chat_prompts(tokenizer) -> list[list[int]]:
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        for text in PROMPT_TEXTS
    ]


def _as_ids(encoded) -> list[int]:
    return list(encoded["input_ids"]) if hasattr(encoded, "keys") else list(encoded)


FAMILIES = {
    # Llama 3.1-style: llama3 rope scaling, untied embeddings, larger rope theta
    "llama3": (
        "llama",
        {
            "tie_word_embeddings": False,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    "llama-linear-rope": (
        "llama",
        {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
    ),
    "qwen2": ("qwen2", {"tie_word_embeddings": True}),
    "qwen3": ("qwen3", {"head_dim": 32, "tie_word_embeddings": False}),
    "mistral": ("mistral", {"sliding_window": None, "tie_word_embeddings": False}),
    # attention windows shorter than most prompts: every layer's (Mistral v0.1), or one of two
    # (Qwen2's max_window_layers: layer_types full, sliding)
    "mistral-window": ("mistral", {"sliding_window": 24, "tie_word_embeddings": False}),
    "qwen2-window": (
        "qwen2",
        {"use_sliding_window": True, "sliding_window": 20, "max_window_layers": 1},
    ),
    # Phi-3: fused q/k/v and gate/up in the checkpoint; Phi-4-mini: rotary over 3/4 of a head
    "phi3": ("phi3", {"tie_word_embeddings": False, "original_max_position_embeddings": 512}),
    # Phi-3.5/Phi-4-mini's longrope: prompts over 48 tokens take the long factors throughout,
    # shorter ones from position 48 on (during their outputs); cos and sin scaled
    "phi3-longrope": (
        "phi3",
        {
            "tie_word_embeddings": False,
            "original_max_position_embeddings": 48,
            "rope_scaling": {
                "rope_type": "longrope",
                "short_factor": [1.0, 1.05, 1.1, 1.2, 1.3, 1.5, 1.8, 2.0],
                "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 14.0, 20.0],
            },
        },
    ),  # fmt: skip
    # Gemma 3: a local layer (window 24, rotary base 10k) and a global one (base 1M), q/k norms,
    # four norms a layer, GELU-tanh, scaled embeddings
    "gemma3": (
        "gemma3_text",
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
            "sliding_window": 24,
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),  # fmt: skip
    # Gemma 2: Gemma 3's layers without q/k norms, attention scores soft-capped (at 0.05 here:
    # at 1.0 this tiny model's greedy tokens were the same capped or not), final logits capped
    "gemma2": (
        "gemma2",
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
            "sliding_window": 24,
            "layer_types": ["sliding_attention", "full_attention"],
            "attn_logit_softcapping": 0.05,
            "final_logit_softcapping": 3.0,
        },
    ),  # fmt: skip
    "phi4-mini": (
        "phi3",
        {
            "partial_rotary_factor": 0.75,
            "tie_word_embeddings": True,
            "original_max_position_embeddings": 512,
        },
    ),  # fmt: skip
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_dir(request, tmp_path_factory, smollm2_dir):
    model_type, overrides = FAMILIES[request.param]
    out_dir = tmp_path_factory.mktemp(request.param)
    config = {**TINY_DECODER, **overrides}
    return save_tiny_model(
        out_dir, smollm2_dir, model_type, randomize_biases_and_norms=True, **config
    )


def test_every_native_family_matches_transformers(family_dir):
    check_concurrent_greedy(family_dir)


@pytest.mark.parametrize("model_fixture", ["tiny_llama_dir", "smollm2_dir"])
def test_concurrent_greedy_matches_transformers(request, model_fixture):
    check_concurrent_greedy(request.getfixturevalue(model_fixture))


def test_partial_rotary_on_the_triton_backend(tmp_path, smollm2_dir):
    """Phi-4-mini's rotary over part of each head through the Triton kernels (interpreted)."""
    model_type, overrides = FAMILIES["phi4-mini"]
    model_dir = save_tiny_model(tmp_path, smollm2_dir, model_type, randomize_biases_and_norms=True,
                                **{**TINY_DECODER, **overrides})  # fmt: skip
    check_concurrent_greedy(model_dir, attention_backend="triton", num_prompts=3)


def check_concurrent_greedy(model_dir, num_prompts: int | None = None, **options):
    core = make_core(model_dir, max_num_batched_tokens=64, **options)
    prompts = [_as_ids(p) for p in _chat_prompts(core.tokenizer)][:num_prompts]
    assert len({len(p) for p in prompts}) >= min(8, len(prompts))  # mixed lengths share batches
    max_new_tokens = 24
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
    outputs = run_to_completion(
        core, {f"r{i}": (prompt, params) for i, prompt in enumerate(prompts)}
    )
    expected = hf_greedy(model_dir, prompts, max_new_tokens)
    for i, want in enumerate(expected):
        assert outputs[f"r{i}"].token_ids == want, f"prompt {i} differs"
    assert core.kv_manager.num_free_blocks == core.kv_manager.num_blocks


def test_longrope_rows_take_the_factors_transformers_gives_them(tmp_path, smollm2_dir):
    """Longrope logprobs against Transformers', in chunks of 16 tokens: a 61-token prompt (over
    original_max_position_embeddings 48) takes the long factors in every row, its first chunks
    included; a 31-token one the short factors until it is 49 tokens long, when its KV is
    recomputed with the long ones (Transformers' generate drops its cache there)."""
    import torch
    from transformers import AutoModelForCausalLM

    model_type, overrides = FAMILIES["phi3-longrope"]
    model_dir = save_tiny_model(tmp_path, smollm2_dir, model_type, randomize_biases_and_norms=True,
                                **{**TINY_DECODER, **overrides})  # fmt: skip
    core = make_core(model_dir, max_num_batched_tokens=16)
    prompts = {len(p): p for p in map(_as_ids, _chat_prompts(core.tokenizer))}
    long_prompt, short_prompt = prompts[61], prompts[31]
    params = SamplingParams(temperature=0.0, max_tokens=30, logprobs=0, prompt_logprobs=0,
                            ignore_eos=True)  # fmt: skip
    cached = dataclasses.replace(params, prompt_logprobs=None)  # prefix-cache hits allowed
    requests = {"long": (long_prompt, params), "short": (short_prompt, params),
                "short-cached": (short_prompt, cached)}  # fmt: skip
    outputs = run_to_completion(core, requests)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, prompt in (("long", long_prompt), ("short", short_prompt)):
            logits = model(torch.tensor([prompt])).logits[0].log_softmax(-1)
            want = [logits[i, prompt[i + 1]].item() for i in range(len(prompt) - 1)]
            got = [entry.logprob for entry in outputs[name].prompt_logprobs[1:]]
            assert got == pytest.approx(want, abs=1e-4), name
        # a model of its own: Transformers' longrope keeps the switch to the long factors in
        # the module (its buffer of frequencies is updated in place)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        generated = model.generate(
            torch.tensor([short_prompt]), attention_mask=torch.ones(1, 31, dtype=torch.long),
            do_sample=False, max_new_tokens=30, output_logits=True, return_dict_in_generate=True,
        )  # fmt: skip
    tokens = generated.sequences[0, 31:].tolist()
    want = [
        step[0].log_softmax(-1)[t].item() for step, t in zip(generated.logits, tokens, strict=True)
    ]
    for name in ("short", "short-cached"):  # the second must not take the first's short KV
        assert outputs[name].token_ids == tokens, name
        got = [entry.logprob for entry in outputs[name].logprobs]
        assert got == pytest.approx(want, abs=1e-4), name


def test_attention_windows_on_the_triton_backend(tmp_path, smollm2_dir):
    """Qwen2's windowed layer beside a full one, through the Triton kernels (interpreted)."""
    model_type, overrides = FAMILIES["qwen2-window"]
    model_dir = save_tiny_model(tmp_path, smollm2_dir, model_type, randomize_biases_and_norms=True,
                                **{**TINY_DECODER, **overrides})  # fmt: skip
    check_concurrent_greedy(model_dir, attention_backend="triton", num_prompts=3)


def test_windowed_prompt_chunks_past_the_rows_as_decodes(tmp_path, smollm2_dir):
    """A 300-token prompt in chunks of 64: its chunks past 256 tokens of context take the
    prefill attention path (those before, the decode path a row at a time), both within the
    window of 24 positions, with a prefix hit on the second request. The blocks before the
    window are released as the prompt moves on: the first request never holds more than a
    chunk and a window of blocks (7 of 16 tokens; 20 without the release)."""
    import random

    model_type, overrides = FAMILIES["mistral-window"]
    model_dir = save_tiny_model(tmp_path, smollm2_dir, model_type, randomize_biases_and_norms=True,
                                **{**TINY_DECODER, **overrides})  # fmt: skip
    core = make_core(model_dir, max_num_batched_tokens=64)
    rng = random.Random(7)
    prompt = [rng.randrange(10, 4000) for _ in range(300)]
    prompts = [prompt, prompt[:280] + [rng.randrange(10, 4000) for _ in range(20)]]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    assert core.kv_manager.window == 24
    held = []  # the blocks request "a" holds after each step

    def count_held() -> None:
        held.append(sum(block is not None for block in core.kv_manager.req_blocks.get("a", [])))

    outputs = run_to_completion(core, {"a": (prompts[0], params)}, after_step=count_held)
    assert max(held) <= 7, held
    outputs |= run_to_completion(core, {"b": (prompts[1], params)})
    assert outputs["b"].num_cached_tokens > 256
    expected = hf_greedy(model_dir, prompts, 8)
    assert [outputs["a"].token_ids, outputs["b"].token_ids] == expected


def test_gemma_final_logit_softcapping_matches_transformers(tmp_path, smollm2_dir):
    """Soft-capping keeps the argmax, so it shows in logprobs: each token's against
    Transformers' capped logits."""
    import torch
    from transformers import AutoModelForCausalLM

    model_type, overrides = FAMILIES["gemma3"]
    config = {**TINY_DECODER, **overrides, "final_logit_softcapping": 3.0}
    model_dir = save_tiny_model(tmp_path, smollm2_dir, model_type, randomize_biases_and_norms=True,
                                **config)  # fmt: skip
    core = make_core(model_dir)
    prompt = _as_ids(_chat_prompts(core.tokenizer)[1])
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=0, ignore_eos=True)
    output = run_to_completion(core, {"r": (prompt, params)})["r"]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        generated = model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False, max_new_tokens=6, output_logits=True, return_dict_in_generate=True,
        )  # fmt: skip
    tokens = generated.sequences[0, len(prompt) :].tolist()
    assert output.token_ids == tokens
    want = [
        step[0].log_softmax(-1)[t].item() for step, t in zip(generated.logits, tokens, strict=True)
    ]
    assert [entry.logprob for entry in output.logprobs] == pytest.approx(want, abs=1e-4)
    assert generated.logits[0].abs().max() <= 3.0  # the cap holds there, so it does here


def test_text_model_of_gemma3_for_conditional_generation(tmp_path, smollm2_dir):
    """A Gemma 3 image-and-text checkpoint (a small vision tower beside the text model, saved by
    Transformers): its text model served natively, the vision weights skipped, greedy tokens
    equal to Transformers' image-and-text model given text only. --model-impl transformers is
    refused in one line."""
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    from llmrpc.engine.loading.loader import load_hf_config, load_tokenizer
    from llmrpc.engine.models import model_class
    from llmrpc.engine.models.gemma import Gemma3TextOfConditionalGeneration

    tokenizer = load_tokenizer(smollm2_dir)
    _, text = FAMILIES["gemma3"]
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
           "pad_token_id": tokenizer.pad_token_id}  # fmt: skip
    config = Gemma3Config(
        text_config={**TINY_DECODER, **text, "vocab_size": len(tokenizer), **ids},
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                       "num_attention_heads": 2, "image_size": 32, "patch_size": 8},
        mm_tokens_per_image=4, boi_token_index=10, eoi_token_index=11, image_token_index=12,
        architectures=["Gemma3ForConditionalGeneration"], **ids,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Gemma3ForConditionalGeneration(config).to(torch.float32)
    names = set(model.state_dict())
    assert any("vision_tower" in name for name in names)
    model.save_pretrained(tmp_path, safe_serialization=True)
    tokenizer.save_pretrained(tmp_path)
    core = make_core(tmp_path, max_num_batched_tokens=64)
    assert type(core.runner.model) is Gemma3TextOfConditionalGeneration
    prompts = [_as_ids(p) for p in _chat_prompts(core.tokenizer)][:4]
    params = SamplingParams(temperature=0.0, max_tokens=12)
    outputs = run_to_completion(core, {f"r{i}": (p, params) for i, p in enumerate(prompts)})
    expected = greedy_generate(model.eval(), prompts, 12)
    assert [outputs[f"r{i}"].token_ids for i in range(len(prompts))] == expected
    with pytest.raises(ValueError, match="served as its text model, natively only"):
        model_class(load_hf_config(tmp_path), "transformers")


def check_under_pressure(model_dir, num_prompts: int, num_blocks: int, **options) -> None:
    """Greedy tokens equal Transformers' for chat prompts longer than the families' windows (24),
    in chunks of 32 tokens, with a prefix hit (the chat template's shared system prompt) and
    preemptions (``num_blocks`` of 16 tokens hold a few requests at a time), each asserted."""
    core = make_core(
        model_dir, num_blocks=num_blocks, max_model_len=112, max_num_batched_tokens=32, **options
    )
    prompts = [_as_ids(p) for p in _chat_prompts(core.tokenizer)][:num_prompts]
    assert min(len(p) for p in prompts) > 24
    preempted = []
    original = core.scheduler.schedule

    def spying():
        output = original()
        preempted.extend(output.preempted)
        return output

    core.scheduler.schedule = spying
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outputs = run_to_completion(core, {f"r{i}": (p, params) for i, p in enumerate(prompts)})
    assert preempted
    assert any(output.num_cached_tokens for output in outputs.values())
    expected = hf_greedy(model_dir, prompts, 16)
    assert [outputs[f"r{i}"].token_ids for i in range(len(prompts))] == expected


@pytest.mark.parametrize(
    "family, backend",
    [
        ("gemma2", "torch"),
        ("gemma3", "torch"),
        ("phi3", "torch"),
        ("mistral-window", "torch"),
        ("gemma2", "triton"),  # its soft-capped scores in the Triton kernels
        ("gemma3", "triton"),
        ("mistral-window", "triton"),
    ],
)
def test_windowed_families_under_pressure(tmp_path, smollm2_dir, family, backend):
    model_type, overrides = FAMILIES[family]
    model_dir = save_tiny_model(tmp_path, smollm2_dir, model_type, randomize_biases_and_norms=True,
                                **{**TINY_DECODER, **overrides})  # fmt: skip
    num_prompts = 9 if backend == "torch" else 4
    check_under_pressure(model_dir, num_prompts, 12 if backend == "torch" else 7,
                         attention_backend=backend)  # fmt: skip
