"""Any causal LM that Transformers implements, on our scheduler and paged KV cache.

``--model-impl transformers`` (or ``auto`` for an architecture with no native model). The Hugging
Face model runs with batch size 1 over the flat batch: ``input_ids`` and ``positions`` become
``[1, num_tokens]``, so learned and rotary position embeddings see each token's true position.
Its attention layers call ``paged_attention_forward``, registered with Transformers' attention
interface, which writes keys and values to our cache and attends per request through it.
"""

from __future__ import annotations

import copy
import functools
import re
from collections.abc import Iterable
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
from torch import nn

from llmrpc.kernels.attention import AttentionMetadata, paged_attention, write_kv

ATTN_IMPLEMENTATION = "llmrpc_paged"


@dataclass
class _Step:
    """What the attention layers of one forward pass need, and what they report back."""

    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    metadata: AttentionMetadata
    positions: torch.Tensor  # [num_tokens]
    layers_done: set[int] = field(default_factory=set)


# Transformers calls the attention function deep inside its own forward, with no argument of ours
# that survives every model's signature; the step travels beside the call instead.
_STEP: ContextVar[_Step | None] = ContextVar("llmrpc_paged_step", default=None)


def paged_attention_forward(
    module: nn.Module,
    query: torch.Tensor,  # [1, num_heads, num_tokens, head_dim], position-encoded
    key: torch.Tensor,  # [1, num_kv_heads, num_tokens, head_dim], not repeated for GQA
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,  # ignored: causality is per request, in the cache
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    step = _STEP.get()
    if step is None:
        raise RuntimeError(f"{ATTN_IMPLEMENTATION} attention runs only inside our model runner")
    _check_attention_supported(module, query, key, step, kwargs)
    key_cache, value_cache = step.kv_caches[module.layer_idx]
    # [num_tokens, num_kv_heads, head_dim]
    keys, values = key[0].transpose(0, 1), value[0].transpose(0, 1)
    write_kv(keys, values, key_cache, value_cache, step.metadata)
    # The caller's scaling, not the module's: OPT scales queries itself and passes 1.0.
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    out = paged_attention(query[0].transpose(0, 1), key_cache, value_cache, step.metadata, scale)
    step.layers_done.add(module.layer_idx)
    return out.unsqueeze(0), None  # [1, num_tokens, num_heads, head_dim], as Transformers expects


def _check_attention_supported(module, query, key, step: _Step, kwargs) -> None:
    """Refuse attention variants paged_attention does not compute, rather than answer wrongly."""
    name = type(module).__name__
    if getattr(module, "layer_idx", None) is None or key.shape[2] != query.shape[2]:
        raise NotImplementedError(f"{name}: only decoder self-attention with a layer_idx is served")
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        raise NotImplementedError(f"{name}: attention logit soft-capping and sinks are unsupported")
    cache_heads, cache_head_dim = step.kv_caches[module.layer_idx][0].shape[2:]
    if key.shape[1] != cache_heads or key.shape[3] != cache_head_dim:
        raise NotImplementedError(
            f"{name}: keys of {key.shape[1]} heads x {key.shape[3]} do not fit the KV cache "
            f"sized from the config ({cache_heads} heads x {cache_head_dim})"
        )
    window = kwargs.get("sliding_window")
    # A window as long as every context is plain causal attention.
    if window is not None and int(step.positions.max()) + 1 > window:
        raise NotImplementedError(
            f"{name}: sliding-window attention is unsupported past {window} tokens; "
            f"lower --max-model-len to {window}"
        )


@functools.cache
def _causal_lm_classes():
    """Transformers' causal LM classes by config class, with our attention registered: imported
    on first use, since Transformers' modeling code takes about 2 s to import (measured on a
    2-core AMD EPYC) and a native model never needs it."""
    from transformers import AttentionInterface
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    return MODEL_FOR_CAUSAL_LM_MAPPING


class TransformersForCausalLM(nn.Module):
    """A Transformers causal LM with our model interface: flat batch in, hidden states out."""

    def __init__(self, config) -> None:
        super().__init__()
        self.check_supported(config)
        # from_config records the attention implementation on the config: keep the engine's clean.
        config = copy.deepcopy(config)
        from transformers import AutoModelForCausalLM  # imported here: see _causal_lm_classes

        self.model = AutoModelForCausalLM.from_config(
            config, attn_implementation=ATTN_IMPLEMENTATION
        )
        self.num_layers = config.num_hidden_layers
        self.logit_softcap = getattr(config, "final_logit_softcapping", None)

    @staticmethod
    def check_supported(config) -> None:
        """Raise ValueError naming the flags unless Transformers can serve this config here."""
        classes = _causal_lm_classes()
        if type(config) not in classes:
            raise ValueError(
                f"--model: {getattr(config, 'architectures', None) or config.model_type} is not a "
                "causal LM that Transformers implements (--model-impl transformers)"
            )
        model_cls = classes[type(config)]
        if not model_cls.is_backend_compatible():
            raise ValueError(
                f"--model-impl transformers: {model_cls.__name__} computes attention itself, "
                "not through Transformers' attention interface, so it cannot use our KV cache"
            )

    def forward(self, input_ids, positions, kv_caches, metadata) -> torch.Tensor:
        step = _Step(kv_caches, metadata, positions)
        token = _STEP.set(step)
        try:
            # No mask and no cache of its own: paged_attention keeps requests apart.
            output = self.model.base_model(
                input_ids=input_ids.unsqueeze(0),
                position_ids=positions.unsqueeze(0),
                use_cache=False,
            )
        finally:
            _STEP.reset(token)
        if len(step.layers_done) != self.num_layers:
            raise NotImplementedError(
                f"--model-impl transformers: {type(self.model).__name__} ran attention through our "
                f"cache in {len(step.layers_done)} of {self.num_layers} layers (recurrent or "
                "hybrid layers keep state we do not page)"
            )
        return output.last_hidden_state[0]  # [num_tokens, hidden_size]

    def _apply(self, fn, recurse: bool = True):
        # .to(bfloat16) would also round the rotary frequencies, shifting every position;
        # Transformers' own low-precision loading keeps them float32, and so do we.
        frequencies = [
            (module, name, buffer)
            for module in self.modules()
            for name, buffer in module.named_buffers(recurse=False)
            if name.endswith("inv_freq")
        ]
        super()._apply(fn, recurse)
        for module, name, original in frequencies:
            setattr(module, name, original.to(getattr(module, name).device))
        return self

    def _load_converted(self, state: dict[str, torch.Tensor]) -> set[str]:
        """Load ``state`` through Transformers' own checkpoint conversions for this model; the
        model's names it set. A name no conversion takes is refused, naming it."""
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import convert_and_load_state_dict_in_model
        from transformers.modeling_utils import LoadStateDictConfig

        config = LoadStateDictConfig(weight_mapping=get_model_conversion_mapping(self.model))
        info = convert_and_load_state_dict_in_model(self.model, state, config)[0]
        if info.unexpected_keys:
            raise ValueError(
                f"unexpected weight {sorted(info.unexpected_keys)[0]!r} in the checkpoint"
            )
        problems = [*info.error_msgs, *map(str, info.conversion_errors.values())]
        problems += [f"{name}: shape mismatch" for name in info.mismatched_keys]
        if problems:
            raise ValueError(f"checkpoint weights could not be converted: {problems[0]}")
        return set(self.model.state_dict()) - set(info.missing_keys)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.model.get_output_embeddings()(hidden).float()
        if self.logit_softcap:  # Gemma-style final soft-capping, done in the HF head's forward
            logits = torch.tanh(logits / self.logit_softcap) * self.logit_softcap
        return logits  # [num_selected_tokens, vocab_size]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors by their Transformers names; tied weights share one tensor.
        Names the model does not hold go through the conversions Transformers applies when it
        loads a checkpoint (a MoE's per-expert weights stacked into its fused ones)."""
        targets = self.model.state_dict(keep_vars=True)  # both names of a tied weight
        prefix = f"{self.model.base_model_prefix}."
        ignored = self.model._keys_to_ignore_on_load_unexpected or []
        loaded: set[int] = set()
        converted: dict[str, torch.Tensor] = {}
        for name, tensor in weights:
            # Older checkpoints (GPT-2 on the hub) leave out the base model's prefix.
            target = targets.get(name, targets.get(prefix + name))
            if target is None:
                if any(re.search(pattern, name) for pattern in ignored):
                    continue  # buffers old checkpoints carry, e.g. GPT-2's causal "attn.bias"
                converted[name] = tensor
                continue
            if target.shape != tensor.shape:  # copy_ would broadcast silently
                raise ValueError(
                    f"weight {name!r} has shape {tuple(tensor.shape)}, "
                    f"the model expects {tuple(target.shape)}"
                )
            with torch.no_grad():
                target.copy_(tensor)
            loaded.add(id(target))
        # the conversion sets new parameters: those it set are known by name
        by_conversion = self._load_converted(converted) if converted else set()
        missing = [
            n
            for n, p in self.model.named_parameters()
            if id(p) not in loaded and n not in by_conversion
        ]
        if missing:
            raise ValueError(f"weights missing from the checkpoint: {missing[:5]}")
