"""The C++ attention kernels (kernel_ops/csrc) against the pure-torch paths they replace."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from attention_plans import forced_choice
from engine_utils import make_core, run_to_completion

from llmrpc.engine.request import SamplingParams
from llmrpc.engine.runner.model_runner import _pad_tables
from llmrpc.kernels import attention, attention_tuning, cpu_ops, elementwise
from llmrpc.kernels.attention import (
    AttentionMetadata,
    PrefillSeq,
    decode_attention_torch,
    prefill,
    store_kv_rows,
)
from llmrpc.kernels.linear_tuning import ROW_BUCKETS

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
    [
        (3, 3, 64, 16),
        (1, 8, 64, 32),
        (2, 1, 128, 16),
        (4, 2, 128, 32),
        (1, 16, 64, 16),
        (2, 4, 64, 8),  # blocks of 8, under an AVX-512 vector: the position-by-position loop
    ],
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


@pytest.mark.parametrize(("num_kv_heads", "group", "head_dim"), [(3, 3, 64), (2, 4, 128)])
def test_decode_kernel_rows_match_on_any_thread_count_and_in_any_batch(
    num_kv_heads, group, head_dim
):
    """Fewer sequences than threads split each sequence over the threads (short ones by KV
    heads; from 256 positions the scores by runs of blocks, the value sums by KV head and slice
    of the head): the same sums, so the same bits as one thread and as the sequence among many."""
    seq_lens = [700, 33, 1000, 16]
    query, key_cache, value_cache, metadata = _case(
        torch.bfloat16, num_kv_heads, group, head_dim, 16, seq_lens
    )
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        batch = _kernel(query, key_cache, value_cache, metadata, 0.125)
        for threads in (2, 3, 4, 9):
            torch.set_num_threads(threads)
            for rows in ([0], [1], [2], [3], [0, 2]):  # [0, 2]: two long sequences, split
                picked = torch.tensor(rows)
                some = AttentionMetadata(
                    **{
                        **metadata.__dict__,
                        "decode_block_tables": metadata.decode_block_tables[picked],
                        "decode_seq_lens": metadata.decode_seq_lens[picked],
                    }
                )
                got = _kernel(query[picked], key_cache, value_cache, some, 0.125)
                assert torch.equal(got, batch[picked]), (threads, rows)
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_decode_kernel_gives_one_sequence_every_thread():
    """One stream's decode step keeps both cores busy: its KV heads are split between them."""
    query, key_cache, value_cache, metadata = _case(torch.float32, 4, 2, 128, 16, [4096])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        call = lambda: _kernel(query, key_cache, value_cache, metadata, 0.1)  # noqa: E731
        assert _threads_busy_during(call) == 2
    finally:
        torch.set_num_threads(before)


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
    bad_table = metadata.decode_block_tables.clone()
    bad_table[0, 1] = key_cache.shape[0]  # one past the cache, in the blocks length 20 reads
    bad_blocks = AttentionMetadata(**{**metadata.__dict__, "decode_block_tables": bad_table})
    with pytest.raises(RuntimeError, match="block id .* out of range"):
        _kernel(query, key_cache, value_cache, bad_blocks, 0.125)
    with pytest.raises(RuntimeError, match="share a dtype"):
        _kernel(query.double(), key_cache, value_cache, metadata, 0.125)
    with pytest.raises(RuntimeError, match="multiple"):
        _kernel(query[:, :3], key_cache, value_cache, metadata, 0.125)  # 3 heads over 2 KV heads


def _prefill_case(dtype, num_kv_heads, group, head_dim, block_size, seq_len, rows, seed=0):
    """A sequence of ``seq_len`` positions whose last ``rows`` are the prompt chunk: random caches
    (never zeros), its blocks scattered over them, queries for the chunk's rows."""
    gen = torch.Generator().manual_seed(seed)
    needed = -(-seq_len // block_size)
    block_ids = torch.randperm(needed + 5, generator=gen)[:needed]
    shape = (needed + 5, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=gen).to(dtype)
    value_cache = torch.randn(shape, generator=gen).to(dtype)
    query = (2 * torch.randn(rows, num_kv_heads * group, head_dim, generator=gen)).to(dtype)
    return query, key_cache, value_cache, PrefillSeq(0, rows, seq_len, block_ids)


def _prefill_kernel(query, key_cache, value_cache, seq, scale):
    return torch.ops.llmrpc_cpu.prefill_attention(
        query, key_cache, value_cache, seq.block_ids, seq.seq_len, scale
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("num_kv_heads", "group", "head_dim", "block_size"),
    [(3, 3, 64, 16), (1, 8, 64, 32), (2, 1, 128, 16), (4, 2, 128, 32), (1, 4, 256, 16)],
)
def test_prefill_kernel_matches_torch_path(dtype, num_kv_heads, group, head_dim, block_size):
    # whole prompts and later chunks; tiles of 32 positions whole and cut short, key chunks of 64
    # whole and cut short, one row
    for seq_len, rows in [(2, 2), (40, 40), (100, 37), (300, 300), (777, 500), (1000, 1)]:
        query, key_cache, value_cache, seq = _prefill_case(
            dtype, num_kv_heads, group, head_dim, block_size, seq_len, rows
        )
        scale = head_dim**-0.5
        expected = torch.empty_like(query)
        prefill(query, key_cache, value_cache, seq, scale, expected, "torch-sdpa")
        got = _prefill_kernel(query, key_cache, value_cache, seq, scale)
        assert got.dtype == dtype and got.shape == expected.shape
        torch.testing.assert_close(got.float(), expected.float(), atol=TOLERANCE[dtype], rtol=0)


def test_a_prompt_chunk_with_strided_heads_takes_the_kernel_as_a_dense_one():
    """Transformers' attention hands over its query as [heads, tokens, dim] transposed: the C++
    path reads a dense copy, with the dense query's output."""
    query, key_cache, value_cache, seq = _prefill_case(torch.bfloat16, 2, 2, 64, 16, 300, 300)
    strided = query.transpose(0, 1).contiguous().transpose(0, 1)
    assert strided.stride(1) != 64 and torch.equal(strided, query)
    got, expected = torch.empty_like(query), torch.empty_like(query)
    prefill(strided, key_cache, value_cache, seq, 0.125, got, "cpp-prefill")
    prefill(query, key_cache, value_cache, seq, 0.125, expected, "cpp-prefill")
    assert torch.equal(got, expected)


def test_prefill_kernel_gives_each_row_its_bits_in_any_chunk_and_on_any_thread_count():
    """A row's output depends on its position and the cache alone: the same bits whether its
    prompt runs in one chunk or several, and on one thread or two (so where the scheduler cuts a
    prompt, and what else the step holds, changes nothing)."""
    query, key_cache, value_cache, seq = _prefill_case(torch.bfloat16, 3, 3, 64, 16, 300, 300)
    whole = _prefill_kernel(query, key_cache, value_cache, seq, 0.125)
    before = torch.get_num_threads()
    try:
        for threads, cuts in [(1, [0, 1, 33, 130, 300]), (2, [0, 97, 98, 299, 300])]:
            torch.set_num_threads(threads)
            for start, end in itertools.pairwise(cuts):
                chunk = PrefillSeq(0, end - start, end, seq.block_ids)
                got = _prefill_kernel(query[start:end], key_cache, value_cache, chunk, 0.125)
                assert torch.equal(got, whole[start:end]), (threads, start, end)
    finally:
        torch.set_num_threads(before)


def test_prefill_kernel_reads_only_its_own_blocks():
    # Other blocks, and the last block past the sequence's length, hold NaN.
    query, key_cache, value_cache, seq = _prefill_case(torch.float32, 2, 3, 64, 16, 70, 30)
    used = set(seq.block_ids.tolist())
    for block in range(key_cache.shape[0]):
        if block not in used:
            key_cache[block], value_cache[block] = float("nan"), float("nan")
    key_cache[seq.block_ids[-1], 70 % 16 :] = float("nan")
    value_cache[seq.block_ids[-1], 70 % 16 :] = float("nan")
    assert torch.isfinite(_prefill_kernel(query, key_cache, value_cache, seq, 0.125)).all()


def test_prefill_kernel_names_a_bad_input():
    query, key_cache, value_cache, seq = _prefill_case(torch.float32, 2, 2, 64, 16, 40, 20)
    op = torch.ops.llmrpc_cpu.prefill_attention
    with pytest.raises(RuntimeError, match="20 query rows cannot end a sequence of 19 positions"):
        op(query, key_cache, value_cache, seq.block_ids, 19, 0.125)
    with pytest.raises(RuntimeError, match="sequence of 49 positions in 3 blocks of 16"):
        op(query, key_cache, value_cache, seq.block_ids, 49, 0.125)
    bad = seq.block_ids.clone()
    bad[1] = key_cache.shape[0]
    with pytest.raises(RuntimeError, match="block id .* out of range"):
        op(query, key_cache, value_cache, bad, 40, 0.125)
    with pytest.raises(RuntimeError, match="share a dtype"):
        op(query.double(), key_cache, value_cache, seq.block_ids, 40, 0.125)
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        op(query[:, :3], key_cache, value_cache, seq.block_ids, 40, 0.125)
    with pytest.raises(RuntimeError, match="head_dim must be a multiple of 16"):
        narrow = [t[..., :56].contiguous() for t in (query, key_cache, value_cache)]
        op(*narrow, seq.block_ids, 40, 0.125)


def test_engine_prompt_chunks_take_the_measured_path_with_the_same_tokens(
    tiny_llama_dir, monkeypatch
):
    """A 300-token prompt, 64 tokens a step: its chunks past the decode kernel's context take the
    C++ prefill kernel where the plan says so, and torch's attention where it says that, with the
    same tokens and logprobs at every prompt and output position."""
    prompt = [(7 * i) % 3000 + 50 for i in range(300)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=3)
    calls = []
    real = attention.prefill

    def counted(query, key_cache, value_cache, seq, scale, output, kernel, *rest):
        calls.append(kernel)
        real(query, key_cache, value_cache, seq, scale, output, kernel, *rest)

    monkeypatch.setattr(attention, "prefill", counted)
    outputs = {}
    for kernel in ("cpp-prefill", "torch-sdpa"):
        monkeypatch.setattr(
            attention_tuning, "choose", forced_choice("prefill", (kernel,) * len(ROW_BUCKETS))
        )
        core = make_core(tiny_llama_dir, max_num_batched_tokens=64)
        calls.clear()
        out = run_to_completion(core, {"long": (prompt, params)})["long"]
        # one chunk a layer: the last (256-300); the others end within the decode kernel's reach
        assert calls == [kernel] * core.model.config.num_hidden_layers, kernel
        outputs[kernel] = (out.token_ids, [entry.top for entry in out.prompt_logprobs[1:]])
    assert outputs["cpp-prefill"][0] == outputs["torch-sdpa"][0]
    for got, expected in zip(*(outputs[k][1] for k in outputs), strict=True):
        assert [t for t, _ in got] == [t for t, _ in expected]
        assert max(abs(a - b) for (_, a), (_, b) in zip(got, expected, strict=True)) < 1e-4


def test_engine_decode_rows_take_the_measured_path_with_the_same_tokens(
    tiny_llama_dir, monkeypatch
):
    """Where the plan gives decode steps of two rows or more torch's path, such steps make no
    C++ decode attention call (not the kernel, the fused qkv call nor the layers' call), the
    one-row steps still do, and greedy tokens and logprobs match the C++ kernel's throughout.
    Four 20-token prompts (one step of 80 rows as decodes), two steps of four decodes, then
    three of one."""
    params = {name: SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=3)
              for name in "abc"}  # fmt: skip
    params["d"] = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)
    prompts = {
        name: [(11 * i + 7 * n) % 3000 + 50 for i in range(20)] for n, name in enumerate(params)
    }
    outputs, counts = {}, {}
    plans = {
        "C++ kernel": ("cpp-decode",) * len(ROW_BUCKETS),
        "torch from 2 rows": ("cpp-decode",) + ("torch-sdpa",) * (len(ROW_BUCKETS) - 1),
    }
    for plan, kernels in plans.items():
        monkeypatch.setattr(attention_tuning, "choose", forced_choice("decode", kernels))
        try:
            core = make_core(tiny_llama_dir)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                out = run_to_completion(core, {n: (prompts[n], params[n]) for n in params})
        finally:
            attention.reset_kernels()
        counts[plan] = {event.key: event.count for event in prof.key_averages()}
        outputs[plan] = {n: (o.token_ids, [e.top for e in o.logprobs]) for n, o in out.items()}
    layers = core.model.config.num_hidden_layers
    assert counts["C++ kernel"].get("llmrpc_cpu::decode_layers") == 6
    forced = counts["torch from 2 rows"]
    assert forced.get("llmrpc_cpu::decode_layers") == 3  # the one-row steps
    assert forced.get("llmrpc_cpu::decode_attention_qkv") == 3 * layers  # (decode_layers')
    assert forced.get("llmrpc_cpu::decode_attention") is None
    assert forced.get("aten::scaled_dot_product_attention") == 3 * layers
    for name, (tokens, tops) in outputs["C++ kernel"].items():
        got_tokens, got_tops = outputs["torch from 2 rows"][name]
        assert got_tokens == tokens, name
        for got, expected in zip(got_tops, tops, strict=True):
            assert [t for t, _ in got] == [t for t, _ in expected], name
            assert max(abs(a - b) for (_, a), (_, b) in zip(got, expected, strict=True)) < 1e-4


def _qkv_case(dtype, num_kv_heads, group, head_dim, block_size):
    """A decode step's fused qkv rows and the tables they attend with: three decodes, and two rows
    of one prompt chunk (the second attends to the first's key), each row's slot the last
    position of its context. The rows are strided (a view into wider rows, as of a larger
    matmul output), and the caches hold random values (never zeros)."""
    seq_lens = [1, block_size + 1, 37, 20, 21]  # rows 3 and 4: one sequence, positions 19 and 20
    _, key_cache, value_cache, metadata = _case(
        dtype, num_kv_heads, group, head_dim, block_size, seq_lens[:4]
    )
    tables = metadata.decode_block_tables
    tables = torch.cat((tables, tables[3:4]))
    slots = [
        tables[row, (length - 1) // block_size].item() * block_size + (length - 1) % block_size
        for row, length in enumerate(seq_lens)
    ]
    num_heads = num_kv_heads * group
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = _random(len(seq_lens), width + 24, dtype=dtype, seed=4)[:, :width]
    angles = _random(len(seq_lens), 1, head_dim // 2, dtype=torch.float32, seed=5)
    cos = torch.cat((angles, angles), -1).cos().to(dtype)
    sin = torch.cat((angles, angles), -1).sin().to(dtype)
    step = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        decode_indices=torch.arange(len(seq_lens)),
        decode_block_tables=tables,
        decode_seq_lens=torch.tensor(seq_lens),
        prefills=[],
        decodes_only=True,
    )
    return qkv, cos, sin, key_cache, value_cache, step, num_heads


def _fused_qkv(qkv, cos, sin, key_cache, value_cache, step, num_heads, scale):
    return torch.ops.llmrpc_cpu.decode_attention_qkv(
        qkv, cos, sin, key_cache, value_cache, step.slot_mapping, step.decode_block_tables,
        step.decode_seq_lens, num_heads, scale,
    )  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("num_kv_heads", "group", "head_dim", "block_size"),
    [(3, 3, 64, 16), (1, 8, 64, 32), (2, 1, 128, 16)],
)
def test_fused_qkv_decode_attention_matches_rotary_store_and_decode_kernels(
    dtype, num_kv_heads, group, head_dim, block_size
):
    """Rotary, the KV store and decode attention in one call give the bits of the three kernels
    one after another (the layers' unfused path): the same output, the same cache contents, and
    the qkv rows left as they were."""
    qkv, cos, sin, key_cache, value_cache, step, num_heads = _qkv_case(
        dtype, num_kv_heads, group, head_dim, block_size
    )
    tokens, scale = qkv.shape[0], head_dim**-0.5
    key_expected, value_expected = key_cache.clone(), value_cache.clone()
    rows = qkv.clone()
    q_and_k = rows[:, : (num_heads + num_kv_heads) * head_dim]
    q_and_k = elementwise.rotary(q_and_k.view(tokens, -1, head_dim), cos, sin)
    query, key = q_and_k.split([num_heads, num_kv_heads], dim=1)
    value = rows[:, (num_heads + num_kv_heads) * head_dim :].view(tokens, num_kv_heads, head_dim)
    store_kv_rows(key, value, key_expected, value_expected, step.slot_mapping, (1.0, 1.0))
    expected = _kernel(query.contiguous(), key_expected, value_expected, step, scale)
    original = qkv.clone()
    got = _fused_qkv(qkv, cos, sin, key_cache, value_cache, step, num_heads, scale)
    assert got.shape == (tokens, num_heads, head_dim) and got.dtype == dtype
    assert torch.equal(got, expected)
    assert torch.equal(key_cache, key_expected) and torch.equal(value_cache, value_expected)
    assert torch.equal(qkv, original)


def test_fused_qkv_decode_attention_names_a_bad_input():
    qkv, cos, sin, key_cache, value_cache, step, num_heads = _qkv_case(torch.float32, 2, 2, 64, 16)
    args = (cos, sin, key_cache, value_cache)
    bad_slots = AttentionMetadata(
        **{**step.__dict__, "slot_mapping": torch.tensor([0, 1, 2, 3, key_cache.shape[0] * 16])}
    )
    with pytest.raises(RuntimeError, match="slot .* out of range"):
        _fused_qkv(qkv, *args, bad_slots, num_heads, 0.125)
    with pytest.raises(RuntimeError, match="qkv rows must hold"):
        _fused_qkv(qkv[:, :-64], *args, step, num_heads, 0.125)
    with pytest.raises(RuntimeError, match="one slot"):
        short = AttentionMetadata(**{**step.__dict__, "slot_mapping": step.slot_mapping[:4]})
        _fused_qkv(qkv, *args, short, num_heads, 0.125)
    with pytest.raises(RuntimeError, match="share a dtype"):
        _fused_qkv(qkv.double(), *args, step, num_heads, 0.125)


# The fused elementwise kernels (kernel_ops/csrc/elementwise.cpp) against their torch operations.
# In float32 they agree to float rounding; in bfloat16/float16 both round at the same places, so
# all but a few elements (where a last float bit decides the rounding) are equal.
ELEMENTWISE_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


def _assert_fused_close(got, expected):
    dtype = expected.dtype
    tolerance = ELEMENTWISE_TOLERANCE[dtype] * expected.abs().max().item()
    assert got.dtype == dtype and got.shape == expected.shape
    torch.testing.assert_close(got.float(), expected.float(), atol=tolerance, rtol=0)
    if dtype != torch.float32:  # rounding at the same places: nearly every element is identical
        assert (got == expected).float().mean() > 0.99


def _random(*shape, dtype, seed=0):
    return (3 * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))).to(dtype)


DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [576, 64, 100])  # 100: not a whole number of vectors
def test_rms_norm_kernels_match_torch(dtype, hidden):
    x, weight = _random(33, hidden, dtype=dtype), _random(hidden, dtype=dtype, seed=1)
    residual = _random(33, hidden, dtype=dtype, seed=2)
    _assert_fused_close(
        elementwise.rms_norm(x, weight, 1e-5), elementwise.rms_norm_torch(x, weight, 1e-5)
    )
    expected_sum = x + residual
    expected = elementwise.rms_norm_torch(expected_sum, weight, 1e-6)
    normed, summed = elementwise.add_rms_norm(x.clone(), residual.clone(), weight, 1e-6)
    assert torch.equal(summed, expected_sum)  # one rounding of the sum, as torch's add
    _assert_fused_close(normed, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [1536, 40])
def test_silu_and_mul_kernel_matches_torch(dtype, width):
    x = _random(17, 2 * width, dtype=dtype)
    gate, up = x.chunk(2, dim=-1)
    _assert_fused_close(elementwise.silu_and_mul(x), torch.nn.functional.silu(gate) * up)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 36])  # 36: halves not a whole number of vectors
def test_rotary_kernel_matches_torch_in_place_on_a_strided_view(dtype, head_dim):
    tokens, heads = 9, 5
    # the query and key heads of a fused qkv row: heads dense, tokens strided by the row
    qkv = _random(tokens, (heads + 2) * head_dim, dtype=dtype)
    x = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    angles = _random(tokens, 1, head_dim // 2, dtype=torch.float32, seed=3)
    cos = torch.cat((angles, angles), -1).cos().to(dtype)
    sin = torch.cat((angles, angles), -1).sin().to(dtype)
    expected = elementwise.rotary_torch(x, cos, sin)
    untouched = qkv[:, heads * head_dim :].clone()
    got = elementwise.rotary(x, cos, sin)
    assert got.data_ptr() == x.data_ptr()  # rotated in place
    _assert_fused_close(got, expected)
    assert torch.equal(qkv[:, heads * head_dim :], untouched)  # the value heads are left alone


def test_elementwise_kernels_name_a_bad_input():
    x = _random(4, 64, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="one value per element"):
        torch.ops.llmrpc_cpu.rms_norm(x, x[0, :32].contiguous(), 1e-6)
    with pytest.raises(RuntimeError, match="even last dimension"):
        torch.ops.llmrpc_cpu.silu_and_mul(x[:, :63].contiguous())
    with pytest.raises(RuntimeError, match="share a dtype"):
        torch.ops.llmrpc_cpu.rotary(x.view(4, 1, 64), x.double(), x.double())


def test_engine_gives_the_same_tokens_and_logprobs_with_and_without_the_kernels(
    tiny_llama_dir, monkeypatch
):
    """A mixed batch (decodes, short prompt chunks that go through the decode kernel row by row,
    a prompt longer than that path takes, a shared prefix), prompts chunked 64 tokens a step:
    the C++ kernels and the torch operations give the same tokens, and the same logprobs at every
    prompt and output position (the random model's greedy tokens alone say little: it mostly
    repeats the last token)."""
    shared = list(range(200, 240))
    prompts = {
        "short": list(range(100, 110)),
        "medium": list(range(300, 360)),
        "long": [(7 * i) % 3000 + 50 for i in range(300)],  # past the row-by-row path's context
        "prefix-a": shared + [5, 6, 7],
        "prefix-b": shared + [8, 9],
    }
    params = SamplingParams(
        temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3, prompt_logprobs=3
    )

    def run():
        core = make_core(tiny_llama_dir, max_num_batched_tokens=64)
        outputs = run_to_completion(core, {name: (p, params) for name, p in prompts.items()})
        return {
            name: (
                out.token_ids,
                [entry.top for entry in out.logprobs],
                [entry.top for entry in out.prompt_logprobs[1:]],
            )
            for name, out in outputs.items()
        }

    with_kernels = run()
    monkeypatch.setitem(cpu_ops._state, "loaded", False)
    assert not cpu_ops.loaded()
    without = run()
    for name, (token_ids, output_tops, prompt_tops) in with_kernels.items():
        assert without[name][0] == token_ids, name
        assert len(prompt_tops) == len(prompts[name]) - 1
        for got, expected in zip(
            output_tops + prompt_tops, without[name][1] + without[name][2], strict=True
        ):
            assert [t for t, _ in got] == [t for t, _ in expected], name
            assert max(abs(a - b) for (_, a), (_, b) in zip(got, expected, strict=True)) < 1e-4, (
                name
            )


def test_decode_steps_run_rotary_the_kv_store_and_attention_in_one_call(
    tiny_llama_dir, cpp_decode_attention
):
    """The Llama layers' decodes-only steps take the fused kernel (the prompt's step too: 40
    tokens of context run as rows of the decode kernel): no separate rotary, KV store or decode
    attention call is left. The step's layers are one ``decode_layers`` call, which makes it."""
    core = make_core(tiny_llama_dir)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        run_to_completion(core, {"a": (list(range(100, 140)), params)})
    calls = {event.key: event.count for event in profile.key_averages()}
    layers = core.model.config.num_hidden_layers
    assert calls.get("llmrpc_cpu::decode_attention_qkv") == 6 * layers  # 6 steps
    assert calls.get("llmrpc_cpu::decode_layers") == 6
    for separate in (
        "llmrpc_cpu::decode_layer",  # each layer's own call: not where they all take one
        "llmrpc_cpu::decode_attention",
        "llmrpc_cpu::rotary",
        "aten::index_copy_",
    ):
        assert separate not in calls


def _linear(kind, in_features, out_features, bias, seed):
    """A linear layer of ``kind`` with random weights (and a bias where asked)."""
    from llmrpc.engine.quantization.layers import Int4Linear, Q8Linear
    from llmrpc.kernels.linear import BlockedLinear, PackedLinear

    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=gen) / in_features**0.5
    b = torch.randn(out_features, generator=gen) if bias else None
    if kind in ("bf16", "fp32-packed"):
        dense = torch.nn.Linear(in_features, out_features, bias=bias)
        dense.weight.data, dense.bias = weight, None if b is None else torch.nn.Parameter(b)
        if kind == "fp32-packed":
            return PackedLinear(dense)
        return BlockedLinear(dense.to(torch.bfloat16))
    b = None if b is None else b.to(torch.bfloat16)
    if kind == "int4":
        return Int4Linear.from_float(weight, b, torch.bfloat16)
    q = torch.randint(-127, 128, (out_features, in_features), generator=gen, dtype=torch.int8)
    d = torch.rand(out_features, in_features // 32, generator=gen) / 256
    zeros = torch.randn(out_features, in_features // 32, generator=gen) / 64
    return Q8Linear.from_blocks(q, d, b, zeros=zeros if kind == "q8-zeros" else None)


def _layer_config(**extra):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=128, intermediate_size=256, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=32, **extra)  # fmt: skip


_LAYER_CONFIG = _layer_config()


def _fill_layer(layer, kind, seed):
    """Random norms, and linear layers of ``kind`` (a bias on qkv), in a decoder layer of
    ``_LAYER_CONFIG``'s shapes."""
    dtype = layer.input_layernorm.weight.dtype
    for norm, offset in ((layer.input_layernorm, 1), (layer.post_attention_layernorm, 2)):
        norm.weight.data = _random(128, dtype=dtype, seed=seed + offset)
    attention, mlp = layer.self_attn, layer.mlp
    attention.qkv_proj = _linear(kind, 128, 256, True, seed + 3)
    attention.o_proj = _linear(kind, 128, 128, False, seed + 4)
    mlp.gate_up_proj = _linear(kind, 128, 512, False, seed + 5)
    mlp.down_proj = _linear(kind, 256, 128, False, seed + 6)


@pytest.mark.parametrize("kind", ["bf16", "int4", "q8", "q8-zeros", "fp32-packed"])
@pytest.mark.parametrize("first", [True, False])
def test_decode_layer_call_gives_the_bits_of_the_layers_own_calls(kind, first, monkeypatch):
    """A Llama layer of each kind of linear layer (a bias on qkv, as Qwen2's), in one
    ``decode_layer`` call against its Python path over the same kernels: the same bits in the
    output, the residual stream and both caches, for a decode step of five rows (two of them
    one prompt chunk), as the first layer (starting the stream) and as a later one."""
    from llmrpc.engine.models import llama

    dtype = torch.float32 if kind == "fp32-packed" else torch.bfloat16
    layer = llama.LlamaDecoderLayer(_LAYER_CONFIG, llama.AttentionOptions(qkv_bias=True))
    _fill_layer(layer.to(dtype), kind, 0)
    _, cos, sin, key_cache, value_cache, step, _ = _qkv_case(dtype, 2, 2, 32, 16)
    hidden = _random(5, 128, dtype=dtype, seed=7)
    residual = None if first else _random(5, 128, dtype=dtype, seed=8)

    def forward():
        caches = (key_cache.clone(), value_cache.clone())
        stream = None if residual is None else residual.clone()
        out, stream = layer((cos, sin), hidden.clone(), stream, caches, step)
        return out, stream, *caches

    calls = []
    real = torch.ops.llmrpc_cpu.decode_layer.default
    monkeypatch.setattr(torch.ops.llmrpc_cpu.decode_layer, "default",
                        lambda *args: calls.append(1) or real(*args))  # fmt: skip
    fused = forward()
    assert calls == [1]
    monkeypatch.setattr(llama.LlamaDecoderLayer, "_layer_spec", lambda self, metadata: None)
    own = forward()
    assert calls == [1]
    names = ("output", "residual", "keys", "values")
    for got, expected, name in zip(fused, own, names, strict=True):
        assert torch.equal(got, expected), name


def _stacked_model(kind, layers=3):
    """A Llama of ``layers`` layers of ``kind``, and one decodes-only step for it: input ids,
    positions, each layer's caches and the step's tables (``_qkv_case``'s five rows)."""
    from llmrpc.engine.models import llama

    dtype = torch.float32 if kind == "fp32-packed" else torch.bfloat16
    model = llama.LlamaForCausalLM(_layer_config(num_hidden_layers=layers, vocab_size=256,
                                                 attention_bias=True)).to(dtype)  # fmt: skip
    for index, layer in enumerate(model.layers):
        _fill_layer(layer, kind, 10 * index)
    model.embed_tokens.weight.data = _random(256, 128, dtype=dtype, seed=99)
    _, _, _, key_cache, value_cache, step, _ = _qkv_case(dtype, 2, 2, 32, 16)
    caches = [(key_cache + i, value_cache - i) for i in range(layers)]
    positions = step.decode_seq_lens - 1
    return model, torch.tensor([3, 70, 5, 200, 17]), positions, caches, step


@pytest.mark.parametrize("kind", ["bf16", "int4", "q8", "q8-zeros", "fp32-packed"])
def test_decode_layers_call_gives_the_bits_of_each_layers_python(kind, monkeypatch):
    """Three Llama layers of each kind of linear layer in one eager ``decode_layers`` call
    against the model's loop over each layer's Python path: the same bits in the hidden rows
    the model returns and in every layer's caches."""
    from llmrpc.engine.models import llama

    model, input_ids, positions, caches, step = _stacked_model(kind)

    def forward():
        own = [(keys.clone(), values.clone()) for keys, values in caches]
        return model(input_ids, positions, own, step), *(t for pair in own for t in pair)

    calls = []
    real = torch.ops.llmrpc_cpu.decode_layers.default
    monkeypatch.setattr(torch.ops.llmrpc_cpu.decode_layers, "default",
                        lambda *args: calls.append(1) or real(*args))  # fmt: skip
    stacked = forward()
    assert calls == [1]
    monkeypatch.setattr(llama.LlamaForCausalLM, "_layer_stack", lambda self, metadata: None)
    monkeypatch.setattr(llama.LlamaDecoderLayer, "_layer_spec", lambda self, metadata: None)
    own = forward()
    assert calls == [1]
    for index, (got, expected) in enumerate(zip(stacked, own, strict=True)):
        assert torch.equal(got, expected), "hidden" if index == 0 else f"cache {index - 1}"


def test_a_layer_without_the_call_leaves_the_others_their_own_calls(monkeypatch):
    """A layer whose down projection has no ``layer_spec`` (a plain ``nn.Linear``, as a wrapper
    would be) takes its Python path; the model's other layers each make their own
    ``decode_layer`` call, and no ``decode_layers`` call is made."""
    model, input_ids, positions, caches, step = _stacked_model("bf16")
    model.layers[1].mlp.down_proj = torch.nn.Linear(256, 128, bias=False).to(torch.bfloat16)
    counts = {"decode_layer": 0, "decode_layers": 0}
    for name in counts:
        op = getattr(torch.ops.llmrpc_cpu, name)

        def counted(*args, real=op.default, name=name):
            counts[name] += 1
            return real(*args)

        monkeypatch.setattr(op, "default", counted)
    model(input_ids, positions, caches, step)
    assert counts == {"decode_layer": 2, "decode_layers": 0}


def test_decode_layers_names_a_bad_input():
    hidden = torch.zeros(2, 64, dtype=torch.bfloat16)
    cache = torch.zeros(4, 16, 1, 32, dtype=torch.bfloat16)
    rows = torch.zeros(2, dtype=torch.long)
    with pytest.raises(RuntimeError, match="decode_layers: for 2 layers .* got 2, 3, 24 and 72"):
        torch.ops.llmrpc_cpu.decode_layers(
            hidden, [hidden[0]] * 3, 1e-5, [hidden] * 24, [0] * 72, hidden, hidden,
            [cache] * 2, [cache] * 2, rows, rows.view(2, 1), rows + 1, 2, 0.1,
        )  # fmt: skip


def test_decode_layer_names_a_bad_input():
    hidden = torch.zeros(2, 64, dtype=torch.bfloat16)
    cache = torch.zeros(4, 16, 1, 32, dtype=torch.bfloat16)
    rows = torch.zeros(2, dtype=torch.long)
    with pytest.raises(RuntimeError, match="decode_layer: linears must hold 12 tensors"):
        torch.ops.llmrpc_cpu.decode_layer(
            hidden, hidden.clone(), True, hidden[0], hidden[0], 1e-5, [None] * 3, [0] * 9,
            hidden, hidden, cache, cache, rows, rows.view(2, 1), rows + 1, 2, 0.1,
        )  # fmt: skip
    with pytest.raises(RuntimeError, match="decode_layer: linear layer 0 has kind 7"):
        torch.ops.llmrpc_cpu.decode_layer(
            hidden, hidden.clone(), True, hidden[0], hidden[0], 1e-5, [hidden] * 12, [7] * 36,
            hidden, hidden, cache, cache, rows, rows.view(2, 1), rows + 1, 2, 0.1,
        )  # fmt: skip


def test_a_failed_build_is_logged_with_the_compiler_error_and_leaves_the_torch_path(
    monkeypatch, caplog
):
    def failing_build():
        raise RuntimeError(
            "Error building extension 'llmrpc_cpu_x': [1/2] c++ -c decode_attention.cpp\n"
            "decode_attention.cpp:3:10: error: ATen/ATen.h: No such file or directory\n"
            "ninja: build stopped: subcommand failed."
        )

    monkeypatch.setattr(cpu_ops, "_state", {})
    monkeypatch.setattr(cpu_ops, "_build", failing_build)
    with caplog.at_level("WARNING", logger="llmrpc.kernels.cpu_ops"):
        assert cpu_ops.load() is False
    assert not cpu_ops.loaded()
    assert "decode_attention.cpp:3:10: error: ATen/ATen.h: No such file" in caplog.text
    x = _random(3, 64, dtype=torch.bfloat16)
    gate, up = x.chunk(2, dim=-1)  # the torch operations answer in the kernels' place
    assert torch.equal(elementwise.silu_and_mul(x), torch.nn.functional.silu(gate) * up)


def test_a_build_lock_left_by_a_killed_build_does_not_hang_the_next_start():
    """torch waits, without end, while a build's lock file exists; a build killed midway leaves
    it behind. In a process of its own: a process loads the kernels' library once. It loads the
    build this module's fixture made (the lock is checked before every load, a built one too),
    so the test costs a load, not a build."""
    script = textwrap.dedent(
        """
        import logging, os, sys, time
        from pathlib import Path
        from torch.utils.cpp_extension import _get_build_directory
        from llmrpc.kernels import cpu_ops

        logging.basicConfig(level=logging.WARNING, stream=sys.stdout)
        real_clear = cpu_ops._clear_stale_lock

        def leave_a_stale_lock(name):  # as a build killed 20 minutes ago would have
            lock = Path(_get_build_directory(name, verbose=False)) / "lock"
            lock.parent.mkdir(parents=True, exist_ok=True)
            lock.touch()
            os.utime(lock, (time.time() - 1200, time.time() - 1200))
            real_clear(name)

        cpu_ops._clear_stale_lock = leave_a_stale_lock
        print("loaded:", cpu_ops.load())
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "did not finish" in done.stdout and "loaded: True" in done.stdout


def test_kernels_split_their_work_over_torchs_thread_team():
    """Each kernel divides its rows with at::parallel_for, which is OpenMP only if the extension is
    compiled and linked with it (else the pragma is dropped and every kernel runs on one thread,
    whatever torch.set_num_threads says). It must join torch's own OpenMP runtime, so the team is
    the size torch is told."""
    before = torch.get_num_threads()
    try:
        for threads in (2, 1, 3):
            torch.set_num_threads(threads)
            assert torch.ops.llmrpc_cpu.parallel_team_size() == threads
    finally:
        torch.set_num_threads(before)


def _threads_busy_during(call, seconds: float = 0.4) -> int:
    """Threads of this process that each gained 50 ms of CPU time or more while ``call`` ran
    again and again for ``seconds`` of wall time (a span, not a count of calls, so a faster
    kernel or a slower machine still gives each working thread time to show)."""

    def cpu_ticks() -> dict[str, int]:
        ticks = {}
        for task in os.listdir("/proc/self/task"):
            try:
                fields = Path(f"/proc/self/task/{task}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            ticks[task] = int(fields[11]) + int(fields[12])  # utime, stime
        return ticks

    before = cpu_ticks()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        call()
    after = cpu_ticks()
    least = 0.05 * os.sysconf("SC_CLK_TCK")
    return sum(1 for task, spent in after.items() if spent - before.get(task, 0) >= least)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
@pytest.mark.parametrize("op", ["rms_norm", "add_rms_norm", "silu_and_mul", "rotary"])
def test_elementwise_kernels_run_on_the_kernel_thread_count(op):
    """A compiled engine fixes torch's count and gives the idle core to our kernels alone: the
    norms, activation and rotary of a prefill take it too, not only the linear layers."""
    x = _random(2048, 4096, dtype=torch.float32)
    weight = _random(4096, dtype=torch.float32, seed=1)
    angles = _random(2048, 1, 64, dtype=torch.float32, seed=3)
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    calls = {
        "rms_norm": lambda: elementwise.rms_norm(x, weight, 1e-5),
        "add_rms_norm": lambda: elementwise.add_rms_norm(x.clone(), x, weight, 1e-5),
        "silu_and_mul": lambda: elementwise.silu_and_mul(x),
        "rotary": lambda: elementwise.rotary(x.view(2048, 32, 128), cos, sin),
    }
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        cpu_ops.set_kernel_threads(2)
        assert _threads_busy_during(calls[op]) == 2
    finally:
        cpu_ops.set_kernel_threads(0)
        torch.set_num_threads(before)


def test_int4_kernel_is_built_where_the_cpu_matches():
    """The blocked int4/Q8_0 kernels exist in the AVX-512 and AVX2 builds (both have AVX2 and
    FMA); in the plain C++ build (run below) int4 layers keep torch's packing. Either computes the
    product within 1% of the sum of |x| |w| (ours quantizes the inputs to int8 per 32;
    tests/engine/test_int4_kernel.py holds the exact checks). The AVX2 kernel (every build with
    the kernel but the one with AVX512-VNNI) reads split int4 chunks."""
    from llmrpc.engine.quantization.layers import Int4Linear, blocked_kernel_available

    expected = cpu_ops._capability() in ("AVX512", "AVX2")
    assert torch.ops.llmrpc_cpu.int4_linear_supported() == expected
    assert blocked_kernel_available() == expected
    layer = Int4Linear.from_float(torch.randn(32, 64), None, torch.bfloat16)
    assert layer.blocked == expected
    assert layer.split == (expected and "-mavx512vnni" not in cpu_ops.compile_flags())
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    weight = layer.dequantize(torch.float32)
    exact = x.float() @ weight.T
    assert ((layer(x).float() - exact).abs() <= 0.01 * (x.float().abs() @ weight.abs().T)).all()


@pytest.mark.parametrize("capability", ["avx2", "default"])
def test_kernels_built_for_narrower_vector_units_match_torch(capability):
    """The AVX2 and plain C++ builds (other code paths, vectors of 8; on an AVX-512 machine, not
    the build the engine loads) are built and checked by the tests above in a process told to
    dispatch so; the AVX2 build's int4 kernel by tests/engine/test_int4_kernel.py as well (all of
    it but the AMX tile path, which that build lacks), and its bfloat16 candidates (the one-row
    form among them) by test_linear_tuning.py's forced-candidate and one-row tests, the
    float32-segment form's bits by test_bf16_linear.py, and --batch-invariant on the torch backend
    by test_batch_invariance.py (where a layer may take the AVX2 kernel in some buckets and its
    float32-segment form in others)."""
    if capability == "avx2" and "avx2" not in Path("/proc/cpuinfo").read_text():
        pytest.skip("this CPU has no AVX2")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    files, selected = [__file__], "(match or own_blocks) and not narrower"
    if capability == "avx2":
        files += [
            str(Path(__file__).with_name(f"test_{name}.py"))
            for name in ("int4_kernel", "linear_tuning", "bf16_linear", "batch_invariance")
        ]
        selected = (
            f"({selected}) or (test_int4_kernel and not tile_path) "
            "or (test_linear_tuning and avx2 and (one_row or (forced and dtype0))) "
            "or test_the_float32_segments_give_the_avx2_kernels_bits "
            "or (test_batch_invariance and torch)"
        )
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files, "-k", selected],
        env=env, capture_output=True, text=True, timeout=600, cwd=Path(__file__).parent,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout
