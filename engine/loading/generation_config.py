"""Server-wide sampling defaults: generation_config.json and --override-generation-config.

``--generation-config auto`` reads the model folder's file (for the packaged default model, over
the sampling its model card uses: ``model_source.PACKAGED_SAMPLING``), ``vllm`` ignores it (the
built-in defaults apply), and any other value names a folder holding one. Only the keys below
carry over; ``max_new_tokens`` becomes the default ``max_tokens``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from llmrpc.engine.loading.model_source import PACKAGED_SAMPLING, generation_config_file

# generation_config.json key -> SamplingParams field
_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def sampling_defaults(
    mode: str, model_dir: Path, overrides: dict[str, Any] | None = None, packaged: bool = False
) -> dict[str, Any]:
    """SamplingParams field -> server default, for the fields a request leaves unset;
    ``packaged``: the model is the packaged default (``--model`` omitted)."""
    defaults: dict[str, Any] = dict(PACKAGED_SAMPLING) if packaged and mode == "auto" else {}
    path = generation_config_file(mode, model_dir)
    if path is not None and path.is_file():
        defaults.update(_read(path))
    for key, value in (overrides or {}).items():
        if key not in _KEYS:
            raise ValueError(
                f"--override-generation-config: unknown key {key!r} "
                f"(known: {', '.join(sorted(_KEYS))})"
            )
        defaults[_KEYS[key]] = value
    return defaults


def _read(path: Path) -> dict[str, Any]:
    content = json.loads(path.read_text())
    return {_KEYS[key]: content[key] for key in _KEYS if content.get(key) is not None}
