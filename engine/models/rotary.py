"""Rotary position embeddings (rotate-half layout) and the rope scaling types we support."""

from __future__ import annotations

import math

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")


def rope_parameters(config) -> dict:
    """Rope settings where the config keeps them (``rope_parameters``, older ``rope_scaling``)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    params.update(getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    if params["rope_type"] == "su":  # longrope's first name, in Phi-3's early configs
        params["rope_type"] = "longrope"
    return params


class RotaryEmbedding(nn.Module):
    """``head_dim``: the dimensions rotary turns; ``config``: the model's (longrope reads its
    context lengths)."""

    def __init__(self, head_dim: int, params: dict, config=None) -> None:
        super().__init__()
        rope_type = params["rope_type"]
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"--rope-scaling: rope type {rope_type!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
            )
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
        inv_freq = 1.0 / (params["rope_theta"] ** exponents)
        if rope_type == "linear":
            inv_freq = inv_freq / params["factor"]
        elif rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, params)
        # longrope: a request longer than this takes the long factors
        self.long_from: int | None = None
        self.scaling = 1.0  # of cos and sin
        if rope_type == "longrope":
            self.long_from = _original_length(params, config)
            factor = params.get("factor") or config.max_position_embeddings / self.long_from
            self.scaling = params.get("attention_factor") or (
                math.sqrt(1 + math.log(factor) / math.log(self.long_from)) if factor > 1 else 1.0
            )
            short, long = (
                torch.tensor(params[key], dtype=torch.float32)
                for key in ("short_factor", "long_factor")
            )
            if short.shape != inv_freq.shape or long.shape != inv_freq.shape:
                raise ValueError(
                    f"rope_scaling longrope: short_factor and long_factor need {len(inv_freq)} "
                    f"entries each (half the rotary dimensions), got {len(short)} and {len(long)}"
                )
            self.register_buffer("long_inv_freq", inv_freq / long, persistent=False)
            inv_freq = inv_freq / short
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # [head_dim // 2]

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype, long_rows: torch.Tensor | None = None
    ):
        """``cos`` and ``sin`` for each position: ``[num_tokens, 1, head_dim]`` each. Longrope:
        ``long_rows`` says which rows take the long factors (None: those at or past
        ``long_from``, as every decode row of a request is long exactly when it is)."""
        freqs = positions.float().unsqueeze(1) * self.inv_freq.unsqueeze(0)
        if self.long_from is not None:
            if long_rows is None:
                long_rows = positions >= self.long_from
            long_freqs = positions.float().unsqueeze(1) * self.long_inv_freq.unsqueeze(0)
            freqs = torch.where(long_rows.unsqueeze(1), long_freqs, freqs)
        emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)
        cos, sin = emb.cos(), emb.sin()
        if self.scaling != 1.0:
            cos, sin = cos * self.scaling, sin * self.scaling
        return cos.to(dtype), sin.to(dtype)


def _original_length(params: dict, config) -> int:
    original = params.get("original_max_position_embeddings") or getattr(
        config, "original_max_position_embeddings", None
    )
    if not original:
        raise ValueError("rope_scaling longrope needs original_max_position_embeddings")
    return int(original)


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths slowed by ``factor``, short ones kept, a ramp between."""
    factor = params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    original = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    ramp = (1 - smooth) * scaled / factor + smooth * scaled
    in_between = (wavelen >= original / high) & (wavelen <= original / low)
    return torch.where(in_between, ramp, scaled)
