"""Embeddings in the engine: MiniLM (native BERT) against sentence-transformers, and a decoder
LM used as an embedder against Transformers' hidden states, in batches with generation."""

from __future__ import annotations

import json

import pytest
import torch
from embedding_models import minilm_dir, sentences
from engine_utils import hf_greedy, make_core, run_to_completion
from torch.nn import functional

from llmrpc.engine.config import CacheConfig, EngineConfig, ModelConfig
from llmrpc.engine.core.engine_core import EngineCore
from llmrpc.engine.core_types import EngineStateError
from llmrpc.engine.loading.loader import CACHE_ENV
from llmrpc.engine.pooling.params import PoolerConfig, PoolingParams, model_pooler_config
from llmrpc.engine.request import InvalidRequestError, SamplingParams
from llmrpc.kernels import linear_tuning

MIN_COSINE = 0.9999


def pooling(**options) -> SamplingParams:
    return SamplingParams(max_tokens=None, pooling=PoolingParams(**options))


def cosines(embeddings: list[list[float]], reference: torch.Tensor) -> torch.Tensor:
    return functional.cosine_similarity(torch.tensor(embeddings), reference.float(), dim=1)


@pytest.fixture(scope="module")
def minilm():
    return make_core(minilm_dir(), num_blocks=512, max_model_len=None)


@pytest.fixture(scope="module")
def texts_and_reference():
    from sentence_transformers import SentenceTransformer

    texts = sentences(100)
    model = SentenceTransformer(str(minilm_dir()), device="cpu")
    return texts, model.encode(texts, convert_to_tensor=True)


def _embed_all(core, prompts, params_of=lambda i: pooling(), stagger=False):
    """Embeddings in prompt order; ``stagger``: one request joins per step (other mixes)."""
    if not stagger:
        requests = {str(i): (p, params_of(i)) for i, p in enumerate(prompts)}
        outputs = run_to_completion(core, requests)
    else:
        outputs = {}
        pending = list(enumerate(prompts))
        while pending or core.has_unfinished_requests:
            if pending:
                i, prompt = pending.pop()
                core.add_request(str(i), prompt, params_of(i))
            outputs.update({o.request_id: o for o in core.step()})
    assert all(outputs[str(i)].error is None for i in range(len(prompts)))
    return [outputs[str(i)].embedding for i in range(len(prompts))]


@pytest.mark.parametrize("stagger", [False, True], ids=["one-batch", "staggered"])
def test_minilm_matches_sentence_transformers(minilm, texts_and_reference, stagger):
    texts, reference = texts_and_reference
    prompts = [minilm.tokenizer.encode(text) for text in texts]
    got = cosines(_embed_all(minilm, prompts, stagger=stagger), reference)
    assert got.min() >= MIN_COSINE, (got.argmin(), got.min())


def test_minilm_dimensions_and_normalize(minilm, texts_and_reference):
    texts, reference = texts_and_reference
    prompts = [minilm.tokenizer.encode(text) for text in texts[:8]]
    raw = torch.tensor(_embed_all(minilm, prompts, lambda i: pooling(normalize=False)))
    assert (raw.norm(dim=1) - 1).abs().min() > 1e-3  # really not normalized
    assert cosines(raw.tolist(), reference[:8]).min() >= MIN_COSINE
    short = torch.tensor(_embed_all(minilm, prompts, lambda i: pooling(dimensions=32)))
    assert short.shape == (8, 32)
    torch.testing.assert_close(short, functional.normalize(raw[:, :32], dim=1))
    with pytest.raises(InvalidRequestError) as error:
        minilm.add_request("too-wide", prompts[0], pooling(dimensions=385))
    assert error.value.field == "dimensions"


def test_minilm_takes_a_full_context_and_refuses_generation(minilm):
    assert minilm.max_model_len == 256  # sentence_bert_config.json's max_seq_length
    prompt = [101] + [2023] * 254 + [102]
    (embedding,) = _embed_all(minilm, [prompt])
    assert len(embedding) == 384
    with pytest.raises(InvalidRequestError) as error:
        minilm.add_request("too-long", prompt + [102], pooling())
    assert error.value.field == "input"
    with pytest.raises(EngineStateError, match="does not generate"):
        minilm.add_request("generate", prompt[:5], SamplingParams(max_tokens=4))


def test_an_encoder_keeps_no_kv_cache():
    """Sized by memory, an encoder's blocks are bookkeeping for a full batch, and hold no bytes;
    the profiling step CUDA sizes memory with (2048 tokens) runs as sequences of 512."""
    core = make_core(minilm_dir(), num_blocks=None, max_model_len=None, max_num_seqs=8)
    assert core.kv_manager.num_blocks == 8 * 256 // 16
    assert core.runner.kv_cache_bytes == 0
    core.runner.profile_run(2048, 8)


def _hf_hidden(model_dir, prompts) -> list[torch.Tensor]:
    """Transformers' last hidden states (after the final norm), float32, one prompt at a time."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([p])).last_hidden_state[0] for p in prompts]


@pytest.fixture(scope="module")
def decoder_case(tiny_llama_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    prompts = [tokenizer.encode(text) for text in sentences(12)]
    prompts.append(tokenizer.encode(" ".join(sentences(10))))  # long: chunked below
    return prompts, _hf_hidden(tiny_llama_dir, prompts)


@pytest.mark.parametrize("chunk", [2048, 24], ids=["whole", "chunked"])
def test_decoder_embeds_beside_generation(tiny_llama_dir, decoder_case, chunk):
    """LAST and MEAN pooling of a generate-runner decoder, in the same steps as generating
    requests; with a 24-token budget prompts are chunked, and the generating requests'
    tokens are still Transformers' greedy tokens."""
    prompts, hidden = decoder_case
    core = make_core(tiny_llama_dir, max_num_batched_tokens=chunk)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    requests = {f"gen{i}": (prompts[i], greedy) for i in range(3)}
    for i, prompt in enumerate(prompts):
        kind = "MEAN" if i % 2 else "LAST"
        requests[str(i)] = (prompt, pooling(pooling_type=kind, normalize=False))
    outputs = run_to_completion(core, requests)
    for i, rows in enumerate(hidden):
        expected = rows.mean(dim=0) if i % 2 else rows[-1]
        torch.testing.assert_close(
            torch.tensor(outputs[str(i)].embedding), expected, atol=1e-4, rtol=1e-4
        )
    expected_tokens = hf_greedy(tiny_llama_dir, prompts[:3], 6)
    assert [outputs[f"gen{i}"].token_ids for i in range(3)] == expected_tokens
    assert core.kv_manager.num_free_blocks == core.kv_manager.num_blocks  # all freed


def test_mean_pooling_after_a_prefix_hit(tiny_llama_dir, decoder_case):
    """A prompt whose prefix is cached: LAST may use the hit, MEAN must compute every row."""
    prompts, hidden = decoder_case
    core = make_core(tiny_llama_dir)
    long_prompt, rows = prompts[-1], hidden[-1]
    run_to_completion(core, {"warm": (long_prompt, SamplingParams(max_tokens=1))})
    outputs = run_to_completion(
        core,
        {
            "mean": (long_prompt, pooling(pooling_type="MEAN", normalize=False)),
            "last": (long_prompt, pooling()),
        },
    )
    assert outputs["last"].num_cached_tokens > 0
    assert outputs["mean"].num_cached_tokens == 0
    torch.testing.assert_close(
        torch.tensor(outputs["mean"].embedding), rows.mean(dim=0), atol=1e-4, rtol=1e-4
    )
    expected = functional.normalize(rows[-1], dim=0)  # a decoder's default: LAST, normalized
    torch.testing.assert_close(torch.tensor(outputs["last"].embedding), expected)


def test_a_step_of_pooling_alone_runs_whatever_kernel_serves_one_row(
    tiny_llama_dir, decoder_case, monkeypatch, tmp_path
):
    """A step whose requests all pool takes logits for no row, so the head is called with zero
    rows, which fall in the one-row bucket. Where the one-row kernel served that bucket (chosen
    by timing on some CPUs), the call failed and stopped the engine."""
    real = linear_tuning.candidates
    if "blocked-gemv" not in real(torch.nn.Linear(64, 64).bfloat16()):
        pytest.skip("the one-row kernel needs AVX512-BF16")
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))  # no measurement of another test read back
    monkeypatch.setattr(linear_tuning, "candidates", lambda linear: ["blocked-gemv"])
    core = make_core(tiny_llama_dir, dtype="bfloat16")
    linear = [c for c in core.measured_kernels.values() if isinstance(c, linear_tuning.LayerChoice)]
    assert linear and all(choice.kernels[0] == "blocked-gemv" for choice in linear)
    prompts, _ = decoder_case
    outputs = run_to_completion(core, {"embed": (prompts[0], pooling())})
    assert outputs["embed"].error is None and len(outputs["embed"].embedding) == 64
    greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    assert len(run_to_completion(core, {"gen": (prompts[0], greedy)})["gen"].token_ids) == 3


def test_an_encoder_needs_a_step_that_fits_its_context():
    with pytest.raises(ValueError, match="--max-num-batched-tokens 200 is smaller than"):
        make_core(minilm_dir(), max_model_len=None, max_num_batched_tokens=200)
    core = make_core(minilm_dir(), max_model_len=512, num_blocks=64)  # up to its positions
    assert core.max_model_len == 512


def test_a_pooling_runner_decoder_embeds_and_refuses_generation(tiny_llama_dir, decoder_case):
    prompts, hidden = decoder_case
    config = EngineConfig(
        model=ModelConfig(model=str(tiny_llama_dir), dtype="float32", runner="pooling"),
        cache=CacheConfig(num_gpu_blocks_override=64),
    )
    core = EngineCore(config)
    assert core.model_info.runner == "pooling"
    with pytest.raises(EngineStateError, match="--runner pooling"):
        core.add_request("generate", prompts[0], SamplingParams(max_tokens=2))
    output = run_to_completion(core, {"embed": (prompts[0], pooling())})["embed"]
    torch.testing.assert_close(
        torch.tensor(output.embedding), functional.normalize(hidden[0][-1], dim=0)
    )


def _write_json(path, value) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value))


def test_pooler_defaults_follow_the_sentence_transformers_folder(tmp_path):
    assert model_pooler_config(minilm_dir(), True, {}) == PoolerConfig("MEAN", True)
    assert model_pooler_config(tmp_path, True, {}) == PoolerConfig("CLS", True)
    assert model_pooler_config(tmp_path, False, {}) == PoolerConfig("LAST", True)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    _write_json(tmp_path / "modules.json", modules)
    _write_json(tmp_path / "1_Pooling" / "config.json", {"pooling_mode_lasttoken": True})
    assert model_pooler_config(tmp_path, True, {}) == PoolerConfig("LAST", False)
    override = {"pooling_type": "cls", "normalize": True}
    assert model_pooler_config(tmp_path, True, override) == PoolerConfig("CLS", True)


def test_a_masked_lm_checkpoint_loads_without_its_head(tmp_path):
    """BertForMaskedLM weights carry a "bert." prefix and an MLM head ("cls."): the encoder
    loads the rest and matches Transformers' hidden states (random weights, GELU, 3 layers)."""
    from transformers import AutoTokenizer, BertConfig, BertForMaskedLM

    config = BertConfig(
        vocab_size=30522,
        hidden_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        intermediate_size=96,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    hf_model = BertForMaskedLM(config).eval()
    hf_model.save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(minilm_dir()).save_pretrained(tmp_path)
    core = make_core(tmp_path, num_blocks=64, max_model_len=None)
    prompts = [[101, 7592, 2088, 102], [101, 2023, 2003, 1037, 3231, 1012, 102]]
    params = {kind: pooling(pooling_type=kind, normalize=False) for kind in ("CLS", "MEAN")}
    requests = {f"{k}{i}": (p, v) for k, v in params.items() for i, p in enumerate(prompts)}
    outputs = run_to_completion(core, requests)
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            rows = hf_model.bert(torch.tensor([prompt])).last_hidden_state[0]
        for kind, expected in (("CLS", rows[0]), ("MEAN", rows.mean(dim=0))):
            got = torch.tensor(outputs[f"{kind}{i}"].embedding)
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)


def test_sentence_transformers_6_pooling_mode(tmp_path):
    modules = [{"idx": 1, "path": "1_Pooling", "type": "sentence_transformers.modules.Pooling"}]
    _write_json(tmp_path / "modules.json", modules)
    _write_json(tmp_path / "1_Pooling" / "config.json", {"pooling_mode": "cls"})
    assert model_pooler_config(tmp_path, False, {}) == PoolerConfig("CLS", False)
    for config in ({"pooling_mode": ["mean", "max"]}, {"pooling_mode_max_tokens": True}):
        _write_json(tmp_path / "1_Pooling" / "config.json", config)
        with pytest.raises(ValueError, match="--override-pooler-config"):
            model_pooler_config(tmp_path, False, {})
        override = {"pooling_type": "MEAN"}
        assert model_pooler_config(tmp_path, False, override) == PoolerConfig("MEAN", False)
