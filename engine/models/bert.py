"""A native BERT encoder (BertModel checkpoints: all-MiniLM, BGE, E5...) for embeddings.

Works on the engine's flat batch like the decoders, but attends bidirectionally within each
sequence and keeps no KV cache: the scheduler gives an encoder's requests whole in one step
(``engine/pooling/pooler.py``), so a sequence is a run of positions that starts at 0. Post-LN
layers, GELU, absolute position embeddings, token type 0 throughout. The module tree mirrors
Transformers' names, so checkpoints load by name (with or without the ``bert.`` prefix).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn
from torch.nn import functional

_ACTIVATIONS = {
    "gelu": lambda x: functional.gelu(x),
    "gelu_new": lambda x: functional.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: functional.gelu(x, approximate="tanh"),
    "relu": functional.relu,
}
# Checkpoint parts an embedding does not use: BertModel's pooler, a masked-LM head, buffers.
_UNUSED_PREFIXES = ("pooler.", "cls.", "embeddings.position_ids")


class BertEmbeddings(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        return self.LayerNorm(hidden + self.token_type_embeddings.weight[0])


class _Dense(nn.Module):
    """A linear layer and a post-LN residual add, as Transformers' BertSelfOutput/BertOutput."""

    def __init__(self, config, in_size: int) -> None:
        super().__init__()
        self.dense = nn.Linear(in_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertSelfAttention(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // self.num_heads
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, hidden: torch.Tensor, batch: _Batch) -> torch.Tensor:
        shape = (hidden.shape[0], self.num_heads, self.head_dim)
        q, k, v = (
            batch.pad(proj(hidden).view(shape)) for proj in (self.query, self.key, self.value)
        )
        out = functional.scaled_dot_product_attention(
            q, k, v, attn_mask=batch.mask, scale=1 / math.sqrt(self.head_dim)
        )  # [num_seqs, num_heads, max_len, head_dim]
        return batch.unpad(out).reshape(hidden.shape[0], -1)


class BertAttention(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = _Dense(config, config.hidden_size)

    def forward(self, hidden: torch.Tensor, batch: _Batch) -> torch.Tensor:
        return self.output(self.self(hidden, batch), hidden)


class BertIntermediate(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        if config.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"BERT activation {config.hidden_act!r} is not supported")
        self.activation = _ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.activation(self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = _Dense(config, config.intermediate_size)

    def forward(self, hidden: torch.Tensor, batch: _Batch) -> torch.Tensor:
        hidden = self.attention(hidden, batch)
        return self.output(self.intermediate(hidden), hidden)


class BertEncoder(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))


class _Batch:
    """The flat batch's sequences as a padded batch for attention: a sequence starts where its
    position is 0 (an encoder's requests are scheduled whole)."""

    def __init__(self, positions: torch.Tensor) -> None:
        self.seq_ids = torch.cumsum(positions == 0, dim=0) - 1  # [num_tokens]
        self.positions = positions
        num_seqs = int(self.seq_ids[-1]) + 1
        lengths = torch.zeros(num_seqs, dtype=torch.long, device=positions.device)
        lengths.scatter_reduce_(0, self.seq_ids, positions + 1, reduce="amax")
        self.num_seqs, self.max_len = num_seqs, int(lengths.max())
        keys = torch.arange(self.max_len, device=positions.device)
        # [num_seqs, 1, 1, max_len]: a query sees its own sequence's keys only
        self.mask = (keys < lengths[:, None])[:, None, None, :]

    def pad(self, rows: torch.Tensor) -> torch.Tensor:
        """[num_tokens, heads, dim] -> [num_seqs, heads, max_len, dim]"""
        padded = rows.new_zeros(self.num_seqs, self.max_len, *rows.shape[1:])
        padded[self.seq_ids, self.positions] = rows
        return padded.transpose(1, 2)

    def unpad(self, padded: torch.Tensor) -> torch.Tensor:
        return padded.transpose(1, 2)[self.seq_ids, self.positions]


class BertModel(nn.Module):
    """The encoder; ``forward`` returns its last hidden states, [num_tokens, hidden_size]."""

    uses_kv_cache = False  # the model runner allocates no KV cache for it

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)

    def forward(self, input_ids, positions, kv_caches=None, metadata=None) -> torch.Tensor:
        batch = _Batch(positions)
        hidden = self.embeddings(input_ids, positions)
        for layer in self.encoder.layer:
            hidden = layer(hidden, batch)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """An encoder samples nothing: no rows (the engine refuses generation on it)."""
        return hidden.new_zeros(hidden.shape[0], 0, dtype=torch.float32)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            name = name.removeprefix("bert.")
            if name.startswith(_UNUSED_PREFIXES):
                continue
            if name not in params:
                raise ValueError(f"unexpected weight {name!r} in the checkpoint")
            with torch.no_grad():
                params[name].copy_(tensor)
            loaded.add(name)
        missing = set(params) - loaded
        if missing:
            raise ValueError(f"weights missing from the checkpoint: {sorted(missing)[:5]}")
