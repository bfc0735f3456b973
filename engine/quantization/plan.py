"""The plan ``--quantization`` makes for a loaded model, and the swap of its layers.

``plan_quantization`` reads the method (``int8``, ``int4`` or ``gguf``) from the model's
config, and ``QuantizationPlan.apply`` carries it out after loading: ``quantize_model`` packs
every ``nn.Linear`` of the model (``layers``), ``lm_head`` included, and for ``gguf``
``quantize_model_from_gguf`` (``gguf_blocks``) serves the file's own blocks. An embedding tied to
``lm_head`` reads its rows from the same packed weight, so the float weight is freed.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from llmrpc.engine.config import ModelConfig
from llmrpc.engine.loading.model_source import locate_model
from llmrpc.engine.quantization.gguf_blocks import quantize_model_from_gguf
from llmrpc.engine.quantization.layers import (
    Int4Linear,
    Int8Linear,
    QuantizedLinear,
    _replace,
    release_freed_memory,
)
from llmrpc.kernels.linear import RowsEmbedding

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class QuantizationPlan:
    """What ``--quantization`` asks of the loaded model: a method, and for gguf the file."""

    method: str  # one of config.QUANTIZATION_METHODS
    gguf_path: Path | None = None

    def apply(self, model: nn.Module, hf_config, dtype: torch.dtype) -> nn.Module:
        if self.method == "gguf":
            return quantize_model_from_gguf(model, self.gguf_path, hf_config, dtype)
        return quantize_model(model, self.method, dtype)


def describe_linear_layers(model: nn.Module, num_packed: int, method: str | None) -> str:
    """The log's line on the linear layers' form after load: quantized ones by kind (they are
    packed by their quantization, not by ``pack_linear_layers``), float ones packed for the CPU."""
    kinds = Counter(type(m).__name__ for m in model.modules() if isinstance(m, QuantizedLinear))
    parts = []
    if kinds:
        by_kind = ", ".join(f"{count} {kind}" for kind, count in sorted(kinds.items()))
        parts.append(f"{kinds.total()} quantized by --quantization {method} ({by_kind})")
    if num_packed or not kinds:
        parts.append(f"{num_packed} in floating point, packed for this CPU")
    return "linear layers: " + "; ".join(parts)


def plan_quantization(model_config: ModelConfig) -> QuantizationPlan | None:
    """The plan for ``model_config.quantization``; None: weights in --dtype."""
    method = model_config.quantization
    if method is None:
        return None
    if method == "gguf":
        source = locate_model(model_config.model)
        if not source.is_gguf:  # ModelConfig checks the name; this, the file found
            raise ValueError(f"--quantization gguf: {source.path} is not a .gguf file")
        return QuantizationPlan(method, source.path)
    return QuantizationPlan(method)


def quantize_model(model: nn.Module, method: str, dtype: torch.dtype) -> nn.Module:
    """Swap every ``nn.Linear`` of ``model`` for its ``method`` (int8 or int4) packed form.

    An ``nn.Embedding`` sharing its weight with a linear layer (a tied ``lm_head``) reads the
    packed rows instead. An int4 layer torch cannot pack (outputs not a multiple of 16, inputs
    not of 32) stays in ``dtype``. Call it on the float32 weights, before ``model.to(dtype)``.
    """
    if method not in ("int8", "int4"):
        raise ValueError(f"--quantization: quantize_model does int8 and int4, not {method!r}")
    kind = Int8Linear if method == "int8" else Int4Linear
    embeddings = _tied_embeddings(model)
    skipped = []
    for name, linear in _plain_modules(model, nn.Linear):
        if kind is Int4Linear and not Int4Linear.supports(linear.out_features, linear.in_features):
            skipped.append(name)
            continue
        packed = kind.from_float(linear.weight, linear.bias, dtype)
        _replace(model, name, packed)
        for embedding_name in embeddings.get(id(linear.weight), ()):
            _replace(model, embedding_name, RowsEmbedding(packed))
    if skipped:
        logger.info("--quantization %s: left in %s (not packable): %s", method, dtype, skipped)
    release_freed_memory()
    return model


def _plain_modules(model: nn.Module, kind: type) -> list[tuple[str, nn.Module]]:
    """Modules of exactly ``kind`` (a subclass may do more in its forward), each once."""
    return [(name, m) for name, m in model.named_modules() if type(m) is kind]


def _tied_embeddings(model: nn.Module) -> dict[int, list[str]]:
    """id of an embedding's weight -> the names of the plain embeddings holding it."""
    tied: dict[int, list[str]] = {}
    for name, embedding in _plain_modules(model, nn.Embedding):
        tied.setdefault(id(embedding.weight), []).append(name)
    return tied


def linear_modules(model: nn.Module) -> Iterable[tuple[str, nn.Module]]:
    """The model's linear layers, packed or not (for reports and tests)."""
    return [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, (nn.Linear, QuantizedLinear))
    ]
