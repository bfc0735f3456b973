"""Rotary embeddings: our frequencies equal Transformers' for every rope type we support."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from llmrpc.engine.models.rotary import RotaryEmbedding, rope_parameters

ROPES = {
    "linear": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
}


@pytest.mark.parametrize("rope_type", sorted(ROPES))
def test_inverse_frequencies_match_transformers(rope_type):
    config = LlamaConfig(
        hidden_size=2048,
        num_attention_heads=16,
        max_position_embeddings=131072,
        rope_parameters=ROPES[rope_type],
    )
    expected, attention_factor = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    ours = RotaryEmbedding(128, rope_parameters(config)).inv_freq
    assert attention_factor == 1.0
    assert torch.allclose(ours, expected.float(), rtol=1e-6, atol=0)
    default = RotaryEmbedding(128, {"rope_type": "default", "rope_theta": 500000.0}).inv_freq
    assert not torch.allclose(ours, default)  # the scaling did change something


def test_unsupported_rope_type_is_refused_naming_the_flag():
    with pytest.raises(ValueError, match="--rope-scaling"):
        RotaryEmbedding(64, {"rope_type": "yarn", "rope_theta": 1e4})
