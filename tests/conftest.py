"""Session-wide fixtures shared by all tests: model folders built or converted once per session."""

# ruff: noqa: E402 - the hub must be switched off before anything imports huggingface_hub

from __future__ import annotations

import os

# Hermetic tests: huggingface_hub reads this once, at import, and then never calls the hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Without a GPU, Triton kernels run in its CPU interpreter; it is read when a kernel is defined.
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from tiny_models import TINY_DECODER, save_tiny_model

from llmrpc.engine.loader import CACHE_ENV, resolve_model_dir

TINY_LLAMA_CONFIG: dict[str, Any] = {
    **TINY_DECODER,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
}


def make_tiny_model_dir(
    tmp_path_factory: pytest.TempPathFactory,
    tokenizer_dir: Path,
    name: str = "tiny-llama",
    seed: int = 0,
    **config_overrides: Any,
) -> Path:
    """Save a random-weight float32 Llama with the tokenizer of ``tokenizer_dir`` to a new folder.

    ``config_overrides`` replace entries of TINY_LLAMA_CONFIG (e.g. ``tie_word_embeddings=False``).
    """
    out_dir = tmp_path_factory.mktemp(name)
    config = {**TINY_LLAMA_CONFIG, **config_overrides}
    return save_tiny_model(out_dir, tokenizer_dir, "llama", seed=seed, **config)


@pytest.fixture(scope="session")
def model_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Converted-model cache: ``$LLMRPC_CACHE_DIR`` if set (reused across runs), else a temp dir."""
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else tmp_path_factory.mktemp("llmrpc-cache")


@pytest.fixture(scope="session")
def smollm2_dir(model_cache_dir: Path) -> Path:
    """The packaged SmolLM2-135M-Instruct, converted from GGUF to a float32 safetensors folder."""
    return resolve_model_dir(None, cache_dir=model_cache_dir)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    """A 2-layer random-weight Llama (hidden 64, GQA 4/2, tied embeddings), SmolLM2 tokenizer."""
    return make_tiny_model_dir(tmp_path_factory, smollm2_dir)


@pytest.fixture(scope="session")
def tiny_model_factory(
    tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path
) -> Callable[..., Path]:
    """``make_tiny_model_dir`` bound to this session: call it with config overrides."""

    def make(**config_overrides: Any) -> Path:
        return make_tiny_model_dir(tmp_path_factory, smollm2_dir, **config_overrides)

    return make
