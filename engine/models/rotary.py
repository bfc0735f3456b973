"""Rotary position embeddings (rotate-half layout) and the rope scaling types we support."""

from __future__ import annotations

import math

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_parameters(config) -> dict:
    """Rope settings where the config keeps them (``rope_parameters``, older ``rope_scaling``)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    params.update(getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, params: dict) -> None:
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
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # [head_dim // 2]

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        """``cos`` and ``sin`` for each position: ``[num_tokens, 1, head_dim]`` each."""
        freqs = positions.float().unsqueeze(1) * self.inv_freq.unsqueeze(0)
        emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


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
