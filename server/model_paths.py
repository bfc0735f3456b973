"""``--hide-model-path``: answers that would name a folder on the server's filesystem (the
model's, an adapter's) name the model or adapter instead.

By default, as vLLM, ``/v1/models`` and ListModels give each model's folder as its ``root``
and an adapter's folder as its path, which a client on the same machine can read; the served
name defaults to ``--model`` as given, a path too. With the flag the served name defaults to
the last component of ``--model`` instead, roots and adapter paths are names, and
GetServerInfo's configuration names the model for ``--model``/``--tokenizer`` and the adapters
for ``--lora-modules``.
"""

from __future__ import annotations

import dataclasses
from pathlib import PurePath

from llmrpc.engine.config import EngineConfig


def engine_config_for(engine_config: EngineConfig, hide: bool) -> EngineConfig:
    """The configuration to load: with ``hide`` and no ``--served-model-name``, the model is
    served under its folder's (or file's) name rather than its path."""
    model = engine_config.model
    if not hide or model.served_model_name or model.model is None:
        return engine_config
    name = PurePath(model.model).name or model.model
    served = dataclasses.replace(model, served_model_name=(name,))
    return dataclasses.replace(engine_config, model=served)


def hidden_config(config: dict[str, str], engine_config: EngineConfig) -> dict[str, str]:
    """GetServerInfo's configuration with the paths of the model and adapters left out."""
    served = config.get("served_model_name", "")
    hidden = {"model": served}
    if config.get("tokenizer"):
        hidden["tokenizer"] = served
    if engine_config.lora.lora_modules:
        hidden["lora_modules"] = ",".join(m.name for m in engine_config.lora.lora_modules)
    return {**config, **hidden}
