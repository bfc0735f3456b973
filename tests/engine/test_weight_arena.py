"""The model's weights gathered into one buffer in step order (engine/runner/weight_arena.py):
the same outputs, every weight in the buffer in module order, ties kept, and the buffer advised
onto huge pages where Linux has them."""

from __future__ import annotations

import pytest
import torch
from engine_utils import vm_flags
from torch import nn

from llmrpc.engine.config import CacheConfig, EngineConfig, ModelConfig
from llmrpc.engine.core import engine_core
from llmrpc.engine.core.engine_core import EngineCore
from llmrpc.engine.request import SamplingParams
from llmrpc.engine.runner import host_memory, weight_arena


def _engine(model_dir, dtype: str) -> EngineCore:
    config = EngineConfig(
        model=ModelConfig(model=str(model_dir), dtype=dtype),
        cache=CacheConfig(kv_cache_memory_gib=0.01),
    )
    return EngineCore(config)


def _greedy(core: EngineCore, prompts: list[list[int]]) -> list[list[int]]:
    for index, prompt in enumerate(prompts):
        core.add_request(str(index), prompt, SamplingParams(temperature=0.0, max_tokens=8))
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while core.has_unfinished_requests:
        for output in core.step():
            tokens[output.request_id] += output.token_ids
    return [tokens[str(i)] for i in range(len(prompts))]


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _held(model: nn.Module) -> list[torch.Tensor]:
    """Every tensor the modules hold, in module order, each once (not oneDNN's opaque ones)."""
    tensors, seen = [], set()
    for module in model.modules():
        held = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        held += [v for v in vars(module).values() if isinstance(v, torch.Tensor)]
        for tensor in held:
            if id(tensor) not in seen and not tensor.is_mkldnn:
                seen.add(id(tensor))
                tensors.append(tensor)
    return tensors


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gathered_weights_give_the_same_tokens(tiny_llama_dir, monkeypatch, dtype):
    prompts = [[5, 6, 7, 8, 9], [300, 301, 302], list(range(1000, 1020))]
    gathered = _greedy(_engine(tiny_llama_dir, dtype), prompts)
    monkeypatch.setattr(engine_core, "gather_weights", lambda model: (0, False))
    assert _greedy(_engine(tiny_llama_dir, dtype), prompts) == gathered


def test_every_weight_lies_in_one_buffer_in_module_order(tiny_model_factory):
    model_dir = tiny_model_factory(tie_word_embeddings=False)
    model = _engine(model_dir, "bfloat16").model
    held = _held(model)
    assert len(held) > 10
    storages = {_storage(t) for t in held}
    assert len(storages) == 1  # one buffer
    pointers = [t.data_ptr() for t in held]
    assert pointers == sorted(pointers)  # module order: a layer's weights, then the next's
    assert all(p % 64 == 0 for p in pointers)
    assert type(model.layers[0].self_attn.qkv_proj).__name__ == "BlockedLinear"


def test_a_tied_head_and_its_embedding_still_share_one_table(tiny_llama_dir):
    model = _engine(tiny_llama_dir, "bfloat16").model
    head = model.lm_head
    ids = torch.tensor([0, 17, 49151])
    # the embedding reads the head's blocks, which moved into the buffer
    assert torch.equal(model.embed_tokens(ids), head.rows(ids))
    assert _storage(head.weight_blocks) == _storage(_held(model)[0])


def test_a_view_stays_where_it_is_and_keeps_its_values():
    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.whole = nn.Parameter(torch.arange(12.0).view(3, 4), requires_grad=False)
            self.register_buffer("part", torch.arange(10.0)[2:6])  # a view of a larger storage

    holder = Holder()
    moved, _ = weight_arena.gather_weights(holder)
    assert moved == 12 * 4
    assert torch.equal(holder.whole, torch.arange(12.0).view(3, 4))
    assert torch.equal(holder.part, torch.tensor([2.0, 3.0, 4.0, 5.0]))


def test_the_buffer_is_advised_onto_huge_pages_where_linux_has_them():
    buffer, advised = host_memory.huge_page_buffer(3 * host_memory.HUGE_PAGE)
    assert buffer.data_ptr() % host_memory.HUGE_PAGE == 0
    assert buffer.numel() == 3 * host_memory.HUGE_PAGE
    assert advised == host_memory.huge_pages_available()
    if not advised:
        pytest.skip("this machine's transparent huge pages are off")
    assert "hg" in vm_flags(buffer.data_ptr())  # the kernel marked it MADV_HUGEPAGE
