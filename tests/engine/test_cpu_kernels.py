"""The C++ decode-attention kernel (kernels/csrc) against the pure-torch path it replaces."""

from __future__ import annotations

import pytest
import torch

from llmrpc.engine.model_runner import _decode_mask, _pad_tables
from llmrpc.kernels import cpu_ops
from llmrpc.kernels.attention import AttentionMetadata, decode_attention_torch

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@pytest.fixture(scope="module", autouse=True)
def kernels():
    assert cpu_ops.load(), "the C++ kernels did not build on this machine (see the log)"


def _case(dtype, num_kv_heads, group, head_dim, block_size, seq_lens, seed=0):
    """Random caches (never zeros), each sequence's blocks scattered over the cache."""
    gen = torch.Generator().manual_seed(seed)
    tables = []
    needed = [-(-length // block_size) for length in seq_lens]
    order = torch.randperm(sum(needed) + 7, generator=gen)[: sum(needed)].tolist()
    for count in needed:
        tables.append(order[:count])
        order = order[count:]
    num_blocks = sum(needed) + 7
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=gen).to(dtype)
    value_cache = torch.randn(shape, generator=gen).to(dtype)
    query = (2 * torch.randn(len(seq_lens), num_kv_heads * group, head_dim, generator=gen)).to(
        dtype
    )
    metadata = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.long),
        decode_indices=torch.arange(len(seq_lens)),
        decode_block_tables=_pad_tables(tables),
        decode_mask=_decode_mask(seq_lens, block_size),
        decode_seq_lens=torch.tensor(seq_lens, dtype=torch.long),
        prefills=[],
    )
    return query, key_cache, value_cache, metadata


def _kernel(query, key_cache, value_cache, metadata, scale):
    return torch.ops.llmrpc_cpu.decode_attention(
        query, key_cache, value_cache, metadata.decode_block_tables, metadata.decode_seq_lens, scale
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("num_kv_heads", "group", "head_dim", "block_size"),
    [(3, 3, 64, 16), (1, 8, 64, 32), (2, 1, 128, 16), (4, 2, 128, 32), (1, 16, 64, 16)],
)
def test_decode_kernel_matches_torch_path(dtype, num_kv_heads, group, head_dim, block_size):
    # lengths 1, within one block, block edges and long contexts, mixed in one batch
    seq_lens = [1, 5, block_size, block_size + 1, 3 * block_size - 1, 300, 1000]
    query, key_cache, value_cache, metadata = _case(
        dtype, num_kv_heads, group, head_dim, block_size, seq_lens
    )
    scale = head_dim**-0.5
    expected = decode_attention_torch(query, key_cache, value_cache, metadata, scale)
    got = _kernel(query, key_cache, value_cache, metadata, scale)
    assert got.dtype == dtype and got.shape == expected.shape
    torch.testing.assert_close(got.float(), expected.float(), atol=TOLERANCE[dtype], rtol=0)


def test_decode_kernel_reads_only_its_own_blocks():
    # Other blocks hold NaN: a read outside the sequence's table or past its length shows up.
    query, key_cache, value_cache, metadata = _case(torch.float32, 2, 3, 64, 16, [7, 40])
    used = set(metadata.decode_block_tables[0, :1].tolist()) | set(
        metadata.decode_block_tables[1, :3].tolist()
    )
    for block in range(key_cache.shape[0]):
        if block not in used:
            key_cache[block], value_cache[block] = float("nan"), float("nan")
    key_cache[metadata.decode_block_tables[0, 0], 7:] = float("nan")  # past length 7
    value_cache[metadata.decode_block_tables[1, 2], 8:] = float("nan")  # past length 40
    got = _kernel(query, key_cache, value_cache, metadata, 0.125)
    assert torch.isfinite(got).all()


def test_decode_kernel_names_a_bad_layout():
    query, key_cache, value_cache, metadata = _case(torch.float32, 2, 2, 64, 16, [20])
    bad_lens = AttentionMetadata(**{**metadata.__dict__, "decode_seq_lens": torch.tensor([33])})
    with pytest.raises(RuntimeError, match="sequence length out of range"):
        _kernel(query, key_cache, value_cache, bad_lens, 0.125)
    with pytest.raises(RuntimeError, match="share a dtype"):
        _kernel(query.double(), key_cache, value_cache, metadata, 0.125)
    with pytest.raises(RuntimeError, match="multiple"):
        _kernel(query[:, :3], key_cache, value_cache, metadata, 0.125)  # 3 heads over 2 KV heads
