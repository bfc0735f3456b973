"""Pooling (embeddings): what a request asks for, what the model does by default, and which
runner a server is (``--runner``, ``--convert``, ``--task``, ``--override-pooler-config``).

Torch-free: the server process builds ``PoolingParams`` and reads the flags; the pooler that
turns a request's hidden rows into its embedding is ``engine/pooling/pooler.py``, on the engine
side.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

POOLING_TYPES = ("LAST", "MEAN", "CLS")
# Architectures that run as bidirectional encoders (engine/models/bert.py): they pool, never
# generate, and take each sequence whole in one step.
ENCODER_ARCHITECTURES = ("BertModel", "BertForMaskedLM", "BertForPreTraining")
_OVERRIDE_KEYS = ("pooling_type", "normalize")
_RUNNERS = ("auto", "generate", "pooling")
_CONVERTS = ("auto", "none", "embed")
_TASKS = (None, "auto", "generate", "embed", "embedding")
_REFUSED_CONVERT = (
    "classification and reward models are not supported yet: this build's pooling runner makes "
    "embeddings (--convert embed)"
)


@dataclass
class PoolingParams:
    """One request's embedding options; None fields take the model's defaults."""

    pooling_type: str | None = None  # LAST, MEAN or CLS
    normalize: bool | None = None  # L2-normalize the (truncated) vector
    dimensions: int | None = None  # Matryoshka: keep the first N values (before normalizing)

    def validate(self, hidden_size: int) -> None:
        from llmrpc.engine.request import InvalidRequestError  # request.py imports this module

        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise InvalidRequestError("pooling_type", f"must be one of {', '.join(POOLING_TYPES)}")
        if self.dimensions is not None and not 1 <= self.dimensions <= hidden_size:
            raise InvalidRequestError(
                "dimensions",
                f"must be in [1, {hidden_size}] (the model's embedding size), got "
                f"{self.dimensions}",
            )


@dataclass(frozen=True)
class PoolerConfig:
    """The model's pooling defaults, after ``--override-pooler-config``."""

    pooling_type: str = "LAST"
    normalize: bool = True


def is_encoder(architectures) -> bool:
    return any(name in ENCODER_ARCHITECTURES for name in architectures or ())


def check_pooling_flags(runner: str, convert: str, task: str | None, overrides: dict) -> None:
    """Refuse what the pooling runner does not do, naming the flag (``ModelConfig``)."""
    if runner == "draft":
        raise ValueError(
            "--runner draft: this build runs a draft model inside the served model's engine, "
            "named by --speculative-config's model (method draft_model), not as a server of "
            "its own"
        )
    if runner not in _RUNNERS:
        raise ValueError(f"--runner must be one of {', '.join(_RUNNERS)}, got {runner!r}")
    if convert in ("classify", "reward"):
        raise ValueError(f"--convert {convert}: {_REFUSED_CONVERT}")
    if convert not in _CONVERTS:
        raise ValueError(f"--convert must be one of {', '.join(_CONVERTS)}, got {convert!r}")
    if task not in _TASKS:
        raise ValueError(
            f"--task {task}: this build serves generate and embed (other tasks are not supported)"
        )
    unknown = sorted(set(overrides) - set(_OVERRIDE_KEYS))
    if unknown:
        raise ValueError(
            f"--override-pooler-config: unknown key(s) {', '.join(map(repr, unknown))}; this "
            f"build takes {' and '.join(_OVERRIDE_KEYS)}"
        )
    kind = overrides.get("pooling_type")
    if kind is not None and str(kind).upper() not in POOLING_TYPES:
        raise ValueError(
            f"--override-pooler-config: pooling_type must be one of {', '.join(POOLING_TYPES)}"
        )
    if "normalize" in overrides and not isinstance(overrides["normalize"], bool):
        raise ValueError("--override-pooler-config: normalize must be true or false")


def resolve_runner(runner: str, convert: str, task: str | None, architectures) -> str:
    """``"generate"`` or ``"pooling"``: what this server's model does."""
    encoder = is_encoder(architectures)
    wants_pooling = runner == "pooling" or convert == "embed" or task in ("embed", "embedding")
    if encoder and (runner == "generate" or task == "generate"):
        raise ValueError(
            f"--runner generate: {', '.join(architectures)} is an encoder-only model; it serves "
            "embeddings (--runner pooling), not text generation"
        )
    return "pooling" if encoder or wants_pooling else "generate"


def model_pooler_config(model_dir: Path, encoder: bool, overrides: dict) -> PoolerConfig:
    """The pooling a model's folder asks for, as vLLM reads it: sentence-transformers'
    ``modules.json`` (its Pooling module's config, a Normalize module), else CLS for an
    encoder and LAST for a decoder, both normalized; then ``--override-pooler-config``.
    A Pooling module this build cannot reproduce (max, weighted mean, several modes
    concatenated) stops start-up unless the override names a pooling_type."""
    pooling_type, normalize = ("CLS" if encoder else "LAST"), True
    modules = _read_json(Path(model_dir) / "modules.json")
    if isinstance(modules, list):
        types = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules}
        normalize = "Normalize" in types
        if "Pooling" in types:
            config = _read_json(Path(model_dir) / types["Pooling"].get("path", "") / "config.json")
            modes = _sentence_transformers_modes(config or {})
            if len(modes) == 1 and modes[0] in _ST_MODES:
                pooling_type = _ST_MODES[modes[0]]
            elif modes and "pooling_type" not in overrides:
                raise ValueError(
                    f"the model's sentence-transformers Pooling module pools by {'+'.join(modes)}"
                    ", which this build does not support (it pools by mean, cls or lasttoken); "
                    "choose one with --override-pooler-config '{\"pooling_type\": ...}'"
                )
    pooling_type = str(overrides.get("pooling_type", pooling_type)).upper()
    normalize = overrides.get("normalize", normalize)
    return PoolerConfig(pooling_type, normalize)


_ST_MODES = {"mean": "MEAN", "cls": "CLS", "lasttoken": "LAST"}
_ST_MODE_KEYS = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_lasttoken": "lasttoken",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
}


def _sentence_transformers_modes(config: dict) -> list[str]:
    """The Pooling module's modes: sentence-transformers 6 writes ``"pooling_mode": "mean"``
    (or a list), earlier versions a boolean per mode."""
    mode = config.get("pooling_mode")
    if mode is not None:
        return [mode] if isinstance(mode, str) else [str(m) for m in mode]
    return [name for key, name in _ST_MODE_KEYS.items() if config.get(key)]


def sentence_transformers_max_len(model_dir: Path) -> int | None:
    """``max_seq_length`` of the folder's ``sentence_bert_config.json``: the length
    sentence-transformers cuts inputs to (256 for all-MiniLM-L6-v2), if it says one."""
    config = _read_json(Path(model_dir) / "sentence_bert_config.json")
    length = config.get("max_seq_length") if isinstance(config, dict) else None
    return length if isinstance(length, int) and length > 0 else None


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
