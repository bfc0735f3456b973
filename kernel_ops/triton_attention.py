"""Paged attention in Triton: writing new keys and values into the KV cache, decode attention
(one new token per sequence, split over the context) and prefill attention (a variable-length
flat batch of new tokens, causal over cached prefix and new tokens alike).

The KV cache of a layer is ``key_cache``/``value_cache``, each ``[num_blocks, block_size,
num_kv_heads, head_dim]``, contiguous, in the query's dtype or in fp8 (``--kv-cache-dtype``: e4m3
or e5m2), where a stored value is ``key / k_scale`` rounded to fp8 (beyond the largest finite
fp8 value, infinities included, the largest; a NaN stays NaN) and is read back as ``fp8 *
k_scale`` rounded to the query's dtype (likewise ``v_scale``); a flat slot is ``block_id *
block_size + offset`` and ``block_tables[s]`` names sequence ``s``'s blocks in order. Every kernel
has a pure-torch twin (``*_torch``) that the tests hold it to, and a wrapper that checks the layout
contract (``ValueError`` naming the argument) before any launch.

The kernels load in the model dtype, feed ``tl.dot`` in it (tensor cores on a GPU) and do all
other arithmetic (softmax scale, exp, sums, the output accumulator) in float32, casting to the
output dtype at the store. ``DOT_F32`` upcasts the dot operands where the interpreter needs it
(bfloat16, see ``triton_utils``). Scores are kept in base 2: the scale carries ``log2(e)`` so the
softmax uses ``exp2``. Masked positions load as 0 and score ``-inf``, so cache slots past a
sequence's length or in padding blocks never contribute, whatever they hold (NaN included).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from llmrpc.kernels.attention import FP8_DTYPES, read_kv, store_kv_rows
from llmrpc.kernels.triton_utils import check, check_device, dot_in_f32

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# fp8 type -> (mantissa bits, exponent of its smallest normal)
_FP8_GRID = {torch.float8_e4m3fn: (3, -6), torch.float8_e5m2: (2, -14)}
_INDEX_DTYPES = (torch.int32, torch.int64)
_LOG2E = math.log2(math.e)
_LOG2E_C = tl.constexpr(_LOG2E)  # the same, inside kernels
# Decode split-K: enough splits that the grid fills _WAVES waves of the device's SMs, at most
# _MAX_SPLITS (a runtime count: every split count runs the same compiled kernels).
_WAVES = 2
_MAX_SPLITS = 256
_INTERPRETER_SMS = 4  # in place of an SM count under the interpreter: few programs, short tests
_TOKENS_PER_ITER = 32  # KV positions a decode program reads per loop iteration (whole blocks)
# 8 warps a decode program: with 4, its float32 tiles of head_dim 128 spill registers (sm_90)
_DECODE_WARPS = 8
_REDUCE_SPLITS = 16  # partial results the reduce kernel combines per loop iteration
_PREFILL_BLOCK_M = 64  # (query token, head) rows of a prefill tile, at most


# ---------------------------------------------------------------------------------------------
# store_kv


@triton.jit(do_not_specialize=["num_tokens"])  # it changes step to step
def _store_kv_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    num_tokens, num_kv_heads,
    k_inv_scale, v_inv_scale,  # 1 / k_scale, 1 / v_scale: used for an fp8 cache only
    HEAD_DIM: tl.constexpr, TOKENS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    FP8: tl.constexpr, MANTISSA: tl.constexpr, MIN_EXPONENT: tl.constexpr, LARGEST: tl.constexpr,
):  # fmt: skip
    # TOKENS tokens a program: copy each one's [num_kv_heads, head_dim] key and value rows to
    # its slot. A padding row (slot -1) and a token past the end leave the cache as it was.
    token = tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)
    slot = tl.load(slot_mapping_ptr + token, mask=token < num_tokens, other=-1).to(tl.int64)
    token = token.to(tl.int64)[:, None, None]
    slot = slot[:, None, None]
    offs_h = tl.arange(0, BLOCK_H)[None, :, None]
    offs_d = tl.arange(0, BLOCK_D)[None, None, :]
    mask = (slot >= 0) & (offs_h < num_kv_heads) & (offs_d < HEAD_DIM)
    # A plain copy (no arithmetic), so the cache gets the bits of key and value; an fp8 cache
    # gets them scaled in float32, rounded once.
    dst = slot * num_kv_heads * HEAD_DIM + offs_h * HEAD_DIM + offs_d
    key = tl.load(key_ptr + token * stride_kt + offs_h * stride_kh + offs_d, mask=mask)
    value = tl.load(value_ptr + token * stride_vt + offs_h * stride_vh + offs_d, mask=mask)
    if FP8:
        key = _to_fp8(
            key, k_inv_scale, key_cache_ptr.dtype.element_ty, MANTISSA, MIN_EXPONENT, LARGEST
        )
        value = _to_fp8(
            value, v_inv_scale, value_cache_ptr.dtype.element_ty, MANTISSA, MIN_EXPONENT, LARGEST
        )
    tl.store(key_cache_ptr + dst, key, mask=mask)
    tl.store(value_cache_ptr + dst, value, mask=mask)


@triton.jit
def _to_fp8(
    x,
    inv_scale,
    dtype: tl.constexpr,
    MANTISSA: tl.constexpr,
    MIN_EXPONENT: tl.constexpr,
    LARGEST: tl.constexpr,
):
    """``x * inv_scale`` in the fp8 ``dtype``, rounded once as torch rounds: beyond the largest
    finite value (infinities included) the largest, as the twin clamps; NaN stays NaN. Written
    out, not left to ``tl.maximum`` (which on a GPU returns the other operand of a NaN) nor to
    the conversion (the interpreter's turns a NaN into a finite e4m3 value)."""
    x = x.to(tl.float32) * inv_scale
    is_nan = x != x
    x = tl.where(is_nan, 0.0, tl.minimum(tl.maximum(x, -LARGEST), LARGEST))
    bits = _round_fp8(x, MANTISSA, MIN_EXPONENT).to(dtype).to(tl.uint8, bitcast=True)
    return tl.where(is_nan, 0x7F, bits).to(tl.uint8).to(dtype, bitcast=True)  # 0x7F: a NaN of both


@triton.jit
def _round_fp8(x, MANTISSA: tl.constexpr, MIN_EXPONENT: tl.constexpr):
    """``x`` (float32, within the fp8 type's range) rounded to nearest even on the fp8 grid of
    ``MANTISSA`` bits whose smallest normal is ``2**MIN_EXPONENT``, held in float32, so that the
    conversion after it is exact: the interpreter's conversion truncates, where torch's and the
    GPU's round."""
    shift: tl.constexpr = 23 - MANTISSA
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + ((1 << (shift - 1)) - 1) + ((bits >> shift) & 1)) >> shift << shift
    normal = bits.to(tl.float32, bitcast=True)
    # below the smallest normal the grid is evenly spaced by 2**(MIN_EXPONENT - MANTISSA):
    # adding and taking away 1.5 * 2**23 steps rounds to it (float32 addition rounds to even)
    magic: tl.constexpr = 1.5 * 2.0 ** (23 + MIN_EXPONENT - MANTISSA)
    subnormal = (x + magic) - magic
    subnormal = tl.where(subnormal == 0.0, x * 0.0, subnormal)  # keeps the sign of a zero
    return tl.where(tl.abs(x) < 2.0**MIN_EXPONENT, subnormal, normal)


@triton.jit
def _load_kv(
    key_cache_ptr, value_cache_ptr, offs, mask, k_scale, v_scale,
    dtype: tl.constexpr, FP8: tl.constexpr, DOT_F32: tl.constexpr,
):  # fmt: skip
    """A block's keys and values as ``tl.dot`` takes them: in ``dtype`` (an fp8 cache's as
    ``x * scale``, rounded once), or float32 where ``DOT_F32``; masked slots 0."""
    k = tl.load(key_cache_ptr + offs, mask=mask, other=0.0)
    v = tl.load(value_cache_ptr + offs, mask=mask, other=0.0)
    if FP8:
        k = (k.to(tl.float32) * k_scale).to(dtype)
        v = (v.to(tl.float32) * v_scale).to(dtype)
    if DOT_F32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


def store_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], last dim contiguous
    value: torch.Tensor,
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int32/int64; -1 skips the row
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write each token's key and value rows to its flat slot of the caches (an fp8 cache gets
    ``key / k_scale`` and ``value / v_scale``)."""
    device = key.device
    for name, t in (("key", key), ("value", value)):
        check(
            t.dim() == 3,
            f"{name} must be [num_tokens, num_kv_heads, head_dim], got shape {tuple(t.shape)}",
        )
        check(t.dtype in _DTYPES, f"{name} is {t.dtype}, expected one of {_DTYPES}")
        check(t.stride(2) == 1, f"{name} must be contiguous in its last dimension")
        check_device(name, t, device)
    check(value.shape == key.shape, f"value has shape {tuple(value.shape)}, key {tuple(key.shape)}")
    check(value.dtype == key.dtype, f"value is {value.dtype}, key {key.dtype}")
    _check_caches(key_cache, value_cache, key.dtype, device, key.shape[1], key.shape[2], "key")
    num_tokens = key.shape[0]
    _check_index("slot_mapping", slot_mapping, (num_tokens,), device)
    if num_tokens == 0:
        return
    num_kv_heads, head_dim = key.shape[1:]
    block_h, block_d = triton.next_power_of_2(num_kv_heads), triton.next_power_of_2(head_dim)
    tokens_per_program = max(1, min(64, 4096 // (block_h * block_d)))
    mantissa, min_exponent = _FP8_GRID.get(key_cache.dtype, (0, 0))
    _store_kv_kernel[(triton.cdiv(num_tokens, tokens_per_program),)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        num_tokens, num_kv_heads, 1.0 / k_scale, 1.0 / v_scale,
        HEAD_DIM=head_dim, TOKENS=tokens_per_program, BLOCK_H=block_h, BLOCK_D=block_d,
        FP8=key_cache.dtype in FP8_DTYPES, MANTISSA=mantissa, MIN_EXPONENT=min_exponent,
        LARGEST=torch.finfo(key_cache.dtype).max if key_cache.dtype in FP8_DTYPES else 0.0,
    )  # fmt: skip


def store_kv_torch(
    key, value, key_cache, value_cache, slot_mapping, k_scale: float = 1.0, v_scale: float = 1.0
) -> None:
    """The twin of ``store_kv``: ``index_copy_`` of the rows whose slot is not -1."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    store_kv_rows(key[keep], value[keep], key_cache, value_cache, slots, (k_scale, v_scale))


# ---------------------------------------------------------------------------------------------
# decode_attention


@triton.jit
def _soft_cap(s, cap):
    """``cap * tanh(s / cap)`` (scores in log2 units, ``cap`` too), tanh written with exp2."""
    return cap * (1.0 - 2.0 / (tl.exp2(s * (2.0 * _LOG2E_C) / cap) + 1.0))


@triton.jit(do_not_specialize=["stride_bs", "blocks_per_split", "window"])  # per step or layer
def _decode_split_kernel(
    query_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, part_max_ptr, part_sum_ptr, part_out_ptr,
    qk_scale,  # softmax scale * log2(e)
    k_scale, v_scale,  # an fp8 cache's scales
    stride_qs, stride_qh, stride_bs, stride_bb, stride_os, stride_oh,
    blocks_per_split,  # a multiple of BLOCKS_PER_ITER
    window,  # the query sees the last `window` positions (0: all)
    softcap,  # scores capped to softcap * tanh(s / softcap), in log2 units (SOFTCAP)
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCKS_PER_ITER: tl.constexpr,
    DOT_F32: tl.constexpr, FP8: tl.constexpr, SOFTCAP: tl.constexpr,
):  # fmt: skip
    # Program (seq, kv_head, split): the GROUP query heads of one KV head over the split's range
    # of the sequence's blocks, so that each K/V block is loaded once for the whole group.
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_kv_heads = tl.num_programs(1)
    num_splits = tl.num_programs(2)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)

    TOKENS: tl.constexpr = BLOCKS_PER_ITER * BLOCK_SIZE  # KV positions an iteration reads
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_t = tl.arange(0, TOKENS)
    heads = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    q_mask = g_mask[:, None] & d_mask[None, :]
    q = tl.load(
        query_ptr + seq.to(tl.int64) * stride_qs + heads[:, None] * stride_qh + offs_d[None, :],
        mask=q_mask,
        other=0.0,
    )
    if DOT_F32:
        q = q.to(tl.float32)

    # Online softmax over the split's blocks, BLOCKS_PER_ITER at a time: running max, sum of
    # exp, unnormalised output. A split's range is whole iterations (blocks_per_split is a
    # multiple), so an iteration never reaches into the next split; past the sequence's end its
    # positions are masked (their table entries are not read).
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    first = split * blocks_per_split
    last = tl.minimum(first + blocks_per_split, tl.cdiv(seq_len, BLOCK_SIZE))
    # a window's first position; the split starts at the iteration that holds it (or is empty)
    seen_from = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    first += tl.maximum(seen_from // BLOCK_SIZE - first, 0) // BLOCKS_PER_ITER * BLOCKS_PER_ITER
    table = block_tables_ptr + seq * stride_bs
    kv_head_offs = kv_head * HEAD_DIM + offs_d[None, :]
    for b in range(first, last, BLOCKS_PER_ITER):
        pos = b * BLOCK_SIZE + offs_t  # [TOKENS]
        t_mask = (pos < seq_len) & (pos >= seen_from)
        block_id = tl.load(table + (pos // BLOCK_SIZE) * stride_bb, mask=t_mask, other=0)
        slot = block_id.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
        kv_offs = slot[:, None] * (num_kv_heads * HEAD_DIM) + kv_head_offs
        kv_mask = t_mask[:, None] & d_mask[None, :]
        k, v = _load_kv(
            key_cache_ptr, value_cache_ptr, kv_offs, kv_mask, k_scale, v_scale,
            query_ptr.dtype.element_ty, FP8, DOT_F32,
        )  # fmt: skip
        # "ieee" only matters for float32 operands: no silent tf32 for float32 models
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
        if SOFTCAP:
            s = _soft_cap(s, softcap)
        s = tl.where(t_mask[None, :], s, float("-inf"))
        # every iteration holds a position in [seen_from, seq_len) (the first holds seen_from's
        # block, b < last), so m_new is finite
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new

    if num_splits == 1:  # the whole context: normalise and write the output
        out = acc / l_i[:, None]
        tl.store(
            out_ptr + seq.to(tl.int64) * stride_os + heads[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=q_mask,
        )
    else:  # partials [num_seqs, num_heads, num_splits(, head_dim)]; an empty split: -inf, 0, 0
        part = (seq * num_kv_heads * GROUP + heads) * num_splits + split
        tl.store(part_max_ptr + part, m_i, mask=g_mask)
        tl.store(part_sum_ptr + part, l_i, mask=g_mask)
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=q_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_reduce_kernel(
    part_max_ptr, part_sum_ptr, part_out_ptr, out_ptr,
    stride_os, stride_oh,
    num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    # Program (seq, head): combine the splits' partials by log-sum-exp, BLOCK_S at a time.
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    first = (seq * tl.num_programs(1) + head) * num_splits
    # the split of the first position seen is never empty, so the max is finite and empty
    # splits weigh exp2(-inf) = 0
    m = tl.full([], float("-inf"), tl.float32)
    for start in range(0, num_splits, BLOCK_S):
        s_mask = start + offs_s < num_splits
        part_max = tl.load(part_max_ptr + first + start + offs_s, mask=s_mask, other=float("-inf"))
        m = tl.maximum(m, tl.max(part_max, 0))
    acc = tl.zeros([BLOCK_D], tl.float32)
    total = tl.zeros([BLOCK_S], tl.float32)
    for start in range(0, num_splits, BLOCK_S):
        s_mask = start + offs_s < num_splits
        part = first + start + offs_s
        part_max = tl.load(part_max_ptr + part, mask=s_mask, other=float("-inf"))
        part_sum = tl.load(part_sum_ptr + part, mask=s_mask, other=0.0)
        part_out = tl.load(
            part_out_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
            mask=s_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        weight = tl.exp2(part_max - m)
        acc += tl.sum(part_out * weight[:, None], 0)
        total += part_sum * weight
    out = acc / tl.sum(total, 0)
    tl.store(
        out_ptr + seq.to(tl.int64) * stride_os + head * stride_oh + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=d_mask,
    )


def decode_attention(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim], last dim contiguous
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32/int64
    seq_lens: torch.Tensor,  # [num_seqs] int32/int64, >= 1
    scale: float,
    *,
    num_splits: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    window: int = 0,
    softcap: float = 0.0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim] in query's dtype
    """Attention of one query token per sequence over its first ``seq_lens[s]`` cached positions
    (``window`` > 0: the last ``window`` of them; ``softcap`` > 0: the scores capped to
    ``softcap * tanh(s / softcap)`` before the softmax).

    The context is cut into at most ``num_splits`` ranges of blocks (whole loop iterations of
    ``blocks_per_iteration(block_size)`` blocks each), one program each per sequence and KV
    head, whose partial results a second kernel combines. ``num_splits=None`` takes
    ``default_num_splits``: from the batch's shape (sequences, KV heads, the block-table width)
    and the device, with no host sync. The result therefore may differ, by rounding only, with
    the batch's size and longest sequence; pass ``num_splits`` to fix it. Every split count runs
    the same compiled kernels. ``seq_lens[s]`` must not exceed the ``max_blocks * block_size``
    positions of its table row (unchecked: that would take a host sync).
    """
    num_seqs, num_heads, head_dim = _check_query(query)
    device = query.device
    num_kv_heads = _check_caches(key_cache, value_cache, query.dtype, device, None, head_dim)
    check(
        num_heads % num_kv_heads == 0,
        f"query has {num_heads} heads, not a multiple of the caches' {num_kv_heads} KV heads",
    )
    _check_block_tables(block_tables, num_seqs, device)
    _check_index("seq_lens", seq_lens, (num_seqs,), device)
    out = _check_out(out, query)
    block_size = key_cache.shape[1]
    max_blocks = block_tables.shape[1]
    if num_splits is None:
        num_splits = default_num_splits(num_seqs, num_kv_heads, max_blocks, block_size, device)
    check(num_splits >= 1, f"num_splits must be at least 1, got {num_splits}")
    if num_seqs == 0:
        return out
    # whole iterations a split; no split without blocks of the table to read
    per_iter = blocks_per_iteration(block_size)
    blocks_per_split = per_iter * triton.cdiv(triton.cdiv(max_blocks, num_splits), per_iter)
    num_splits = max(1, triton.cdiv(max_blocks, blocks_per_split))

    group = num_heads // num_kv_heads
    shape = (num_seqs, num_heads, num_splits) if num_splits > 1 else (1,)  # one split: unused
    part_max = torch.empty(shape, dtype=torch.float32, device=device)
    part_sum = torch.empty_like(part_max)
    part_out = torch.empty(*shape, head_dim, dtype=torch.float32, device=device)
    block_d = max(16, triton.next_power_of_2(head_dim))
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        query, key_cache, value_cache, block_tables, seq_lens,
        out, part_max, part_sum, part_out,
        scale * _LOG2E, k_scale, v_scale,
        query.stride(0), query.stride(1), block_tables.stride(0), block_tables.stride(1),
        out.stride(0), out.stride(1),
        blocks_per_split, window, softcap * _LOG2E,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_G=max(16, triton.next_power_of_2(group)),  # the smallest tensor-core tile
        BLOCK_D=block_d, BLOCKS_PER_ITER=per_iter, DOT_F32=dot_in_f32(query.dtype),
        FP8=key_cache.dtype in FP8_DTYPES, SOFTCAP=softcap > 0, num_warps=_DECODE_WARPS,
    )  # fmt: skip
    if num_splits > 1:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            part_max, part_sum, part_out, out,
            out.stride(0), out.stride(1),
            num_splits,
            HEAD_DIM=head_dim, BLOCK_S=_REDUCE_SPLITS, BLOCK_D=block_d,
        )  # fmt: skip
    return out


def blocks_per_iteration(block_size: int) -> int:
    """KV blocks the decode kernel reads in one loop iteration: ``_TOKENS_PER_ITER`` tokens'
    worth, at least one block."""
    return max(1, _TOKENS_PER_ITER // block_size)


def default_num_splits(
    num_seqs: int, num_kv_heads: int, max_blocks: int, block_size: int, device: torch.device
) -> int:
    """``decode_attention``'s split count: the fewest that make the grid (``num_seqs x
    num_kv_heads x splits`` programs) fill ``_WAVES`` waves of the device's multiprocessors, at
    most ``_MAX_SPLITS`` and at most one per loop iteration of a table ``max_blocks`` wide."""
    programs = _WAVES * multiprocessor_count(device)
    splits = triton.cdiv(programs, max(1, num_seqs * num_kv_heads))
    iterations = triton.cdiv(max_blocks, blocks_per_iteration(block_size))
    return max(1, min(splits, _MAX_SPLITS, iterations))


def multiprocessor_count(device: torch.device) -> int:
    """The SMs of a CUDA ``device``; elsewhere (the interpreter, which runs one program at a
    time) ``_INTERPRETER_SMS``."""
    if device.type != "cuda":
        return _INTERPRETER_SMS
    return _cuda_multiprocessors(
        device.index if device.index is not None else torch.cuda.current_device()
    )


@functools.cache
def _cuda_multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def decode_attention_torch(
    query,
    key_cache,
    value_cache,
    block_tables,
    seq_lens,
    scale,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """The twin of ``decode_attention``: gather the blocks, mask, softmax in float32."""
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    context = block_tables.shape[1] * block_size
    # [num_seqs, context, num_kv_heads, head_dim]; positions past seq_len zeroed (may be NaN)
    positions = torch.arange(context, device=query.device)
    valid = positions < seq_lens.view(-1, 1)
    if window > 0:
        valid &= positions >= seq_lens.view(-1, 1) - window
    rows = (num_seqs, context, num_kv_heads, head_dim)
    keys = _read(key_cache[block_tables.long()].reshape(rows), k_scale, query.dtype)
    values = _read(value_cache[block_tables.long()].reshape(rows), v_scale, query.dtype)
    keys = keys.masked_fill(~valid[:, :, None, None], 0.0)
    values = values.masked_fill(~valid[:, :, None, None], 0.0)
    # query heads sharing a KV head: [num_seqs, num_kv_heads, group, head_dim]
    q = query.float().reshape(num_seqs, num_kv_heads, -1, head_dim)
    scores = _capped(torch.einsum("skgd,slkd->skgl", q, keys) * scale, softcap)
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    out = torch.einsum("skgl,slkd->skgd", scores.softmax(-1), values)
    return out.reshape(num_seqs, num_heads, head_dim).to(query.dtype)


def _capped(scores: torch.Tensor, softcap: float) -> torch.Tensor:
    return torch.tanh(scores / softcap) * softcap if softcap > 0 else scores


def _read(cache_rows: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Cached rows as the kernels read them, in float32."""
    return read_kv(cache_rows, scale, dtype).float()


# ---------------------------------------------------------------------------------------------
# prefill_attention


@triton.jit(do_not_specialize=["stride_bs", "window"])  # they change step to step, layer to layer
def _prefill_kernel(
    query_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, query_start_loc_ptr,
    seq_lens_ptr, out_ptr,
    qk_scale,  # softmax scale * log2(e)
    k_scale, v_scale,  # an fp8 cache's scales
    stride_qt, stride_qh, stride_bs, stride_bb, stride_ot, stride_oh,
    window,  # a query sees the last `window` positions up to its own (0: all)
    softcap,  # scores capped to softcap * tanh(s / softcap), in log2 units (SOFTCAP)
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, DOT_F32: tl.constexpr, FP8: tl.constexpr,
    SOFTCAP: tl.constexpr,
):  # fmt: skip
    # Program (tile, kv_head, seq): BLOCK_M rows of (query token, query head of the KV head's
    # group) pairs, token-major, against the sequence's keys block by block (flash attention).
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.program_id(2)
    num_kv_heads = tl.num_programs(1)
    q_start = tl.load(query_start_loc_ptr + seq).to(tl.int32)
    num_q = tl.load(query_start_loc_ptr + seq + 1).to(tl.int32) - q_start
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)

    if tile * BLOCK_M >= num_q * GROUP:  # the grid fits the longest sequence: nothing here
        return
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    token = rows // GROUP
    heads = kv_head * GROUP + rows % GROUP
    # query i of the sequence sits at position seq_len - num_q + i and sees keys up to there
    q_pos = seq_len - num_q + token
    offs_d = tl.arange(0, BLOCK_D)
    offs_t = tl.arange(0, BLOCK_SIZE)
    d_mask = offs_d < HEAD_DIM
    q_mask = (token < num_q)[:, None] & d_mask[None, :]
    q_offs = (q_start + token).to(tl.int64)[:, None] * stride_qt + heads[:, None] * stride_qh
    q = tl.load(query_ptr + q_offs + offs_d[None, :], mask=q_mask, other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # blocks up to the tile's last query position
    last_pos = tl.minimum(seq_len - num_q + (tile * BLOCK_M + BLOCK_M - 1) // GROUP, seq_len - 1)
    num_blocks = last_pos // BLOCK_SIZE + 1
    # from the block of the tile's first query's first position seen
    first_block = 0
    if window > 0:
        first_block = tl.maximum(seq_len - num_q + (tile * BLOCK_M) // GROUP - window + 1, 0)
        first_block = first_block // BLOCK_SIZE
    kv_head_offs = kv_head * HEAD_DIM + offs_d[None, :]
    for b in range(first_block, num_blocks):
        block_id = tl.load(block_tables_ptr + seq * stride_bs + b * stride_bb).to(tl.int64)
        k_pos = b * BLOCK_SIZE + offs_t
        kv_offs = (block_id * BLOCK_SIZE + offs_t[:, None]) * (num_kv_heads * HEAD_DIM)
        kv_offs += kv_head_offs
        kv_mask = (k_pos < seq_len)[:, None] & d_mask[None, :]
        k, v = _load_kv(
            key_cache_ptr, value_cache_ptr, kv_offs, kv_mask, k_scale, v_scale,
            query_ptr.dtype.element_ty, FP8, DOT_F32,
        )  # fmt: skip
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
        if SOFTCAP:
            s = _soft_cap(s, softcap)
        # causal (which also keeps k_pos < seq_len for the tile's real rows), within the window
        seen = k_pos[None, :] <= q_pos[:, None]
        if window > 0:
            seen &= k_pos[None, :] > q_pos[:, None] - window
        s = tl.where(seen, s, float("-inf"))
        # without a window block 0 holds position 0, seen by every row, so m_new is finite from
        # the first block on; in a window a row may see nothing in the tile's first blocks
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new

    out = acc / l_i[:, None]
    o_offs = (q_start + token).to(tl.int64)[:, None] * stride_ot + heads[:, None] * stride_oh
    tl.store(out_ptr + o_offs + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=q_mask)


def prefill_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], last dim contiguous
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32/int64
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32/int64, cumulative row counts
    seq_lens: torch.Tensor,  # [num_seqs] int32/int64: context length after this step
    scale: float,
    *,
    max_query_len: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    window: int = 0,
    softcap: float = 0.0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim] in query's dtype
    """Causal attention of a flat batch of new tokens over their sequences' cached context
    (``window`` > 0: each over the last ``window`` positions up to its own; ``softcap`` > 0: the
    scores capped as ``decode_attention`` caps them).

    Sequence ``s`` owns query rows ``query_start_loc[s]:query_start_loc[s + 1]``; its keys and
    values (cached prefix and this step's tokens) are already in the cache, and query ``i`` of
    its ``num_q`` sits at position ``seq_lens[s] - num_q + i``. ``max_query_len`` (the most rows
    of a sequence) sizes the grid; without it, it is read from ``query_start_loc`` (a host sync).
    Unchecked, for the same reason: the offsets match ``query``'s rows, ``num_q <= seq_lens[s]``
    and the table rows hold ``seq_lens[s]`` positions.
    """
    num_tokens, num_heads, head_dim = _check_query(query)
    device = query.device
    num_kv_heads = _check_caches(key_cache, value_cache, query.dtype, device, None, head_dim)
    check(
        num_heads % num_kv_heads == 0,
        f"query has {num_heads} heads, not a multiple of the caches' {num_kv_heads} KV heads",
    )
    check(seq_lens.dim() == 1, f"seq_lens must be [num_seqs], got shape {tuple(seq_lens.shape)}")
    num_seqs = seq_lens.shape[0]
    _check_index("seq_lens", seq_lens, (num_seqs,), device)
    _check_index("query_start_loc", query_start_loc, (num_seqs + 1,), device)
    _check_block_tables(block_tables, num_seqs, device)
    out = _check_out(out, query)
    if num_seqs == 0 or num_tokens == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    check(max_query_len >= 1, f"max_query_len must be at least 1, got {max_query_len}")

    group = num_heads // num_kv_heads
    rows = max_query_len * group
    block_m = min(_PREFILL_BLOCK_M, max(16, triton.next_power_of_2(rows)))
    _prefill_kernel[(triton.cdiv(rows, block_m), num_kv_heads, num_seqs)](
        query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, out,
        scale * _LOG2E, k_scale, v_scale,
        query.stride(0), query.stride(1), block_tables.stride(0), block_tables.stride(1),
        out.stride(0), out.stride(1), window, softcap * _LOG2E,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=key_cache.shape[1], BLOCK_M=block_m,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), DOT_F32=dot_in_f32(query.dtype),
        FP8=key_cache.dtype in FP8_DTYPES, SOFTCAP=softcap > 0,
    )  # fmt: skip
    return out


def prefill_attention_torch(
    query,
    key_cache,
    value_cache,
    block_tables,
    query_start_loc,
    seq_lens,
    scale,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """The twin of ``prefill_attention``: one sequence at a time, softmax in float32."""
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    out = torch.empty_like(query)
    for s in range(seq_lens.shape[0]):
        start, end = int(query_start_loc[s]), int(query_start_loc[s + 1])
        seq_len, num_q = int(seq_lens[s]), end - start
        blocks = block_tables[s, : triton.cdiv(seq_len, block_size)].long()
        keys = key_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        values = value_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        keys, values = _read(keys, k_scale, query.dtype), _read(values, v_scale, query.dtype)
        q = query[start:end].float().reshape(num_q, num_kv_heads, -1, head_dim)
        scores = _capped(torch.einsum("qkgd,lkd->kgql", q, keys) * scale, softcap)
        q_pos = torch.arange(num_q, device=query.device) + seq_len - num_q
        keys_at = torch.arange(seq_len, device=query.device)
        causal = keys_at <= q_pos.view(-1, 1)
        if window > 0:
            causal &= keys_at > q_pos.view(-1, 1) - window
        scores = scores.masked_fill(~causal, float("-inf"))
        rows = torch.einsum("kgql,lkd->qkgd", scores.softmax(-1), values)
        out[start:end] = rows.reshape(num_q, num_heads, head_dim).to(query.dtype)
    return out


# ---------------------------------------------------------------------------------------------
# layout contract


def _check_query(query: torch.Tensor) -> tuple[int, int, int]:
    check(
        query.dim() == 3,
        f"query must be [tokens, num_heads, head_dim], got shape {tuple(query.shape)}",
    )
    check(query.dtype in _DTYPES, f"query is {query.dtype}, expected one of {_DTYPES}")
    check(query.stride(2) == 1, "query must be contiguous in its last dimension")
    check_device("query", query, query.device)
    return tuple(query.shape)


def _check_caches(key_cache, value_cache, dtype, device, num_kv_heads, head_dim, of="query"):
    """Both caches ``[num_blocks, block_size, num_kv_heads, head_dim]``, contiguous, in ``dtype``
    (``of``'s) or fp8, and matching ``of``'s head count (where given) and head size; returns the
    former."""
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        check(
            cache.dim() == 4,
            f"{name} must be [num_blocks, block_size, num_kv_heads, "
            f"head_dim], got shape {tuple(cache.shape)}",
        )
        check(
            cache.dtype in (dtype, *FP8_DTYPES),
            f"{name} is {cache.dtype}, expected {dtype} (the {of}'s) or an fp8 dtype",
        )
        check(cache.is_contiguous(), f"{name} must be contiguous")
        check_device(name, cache, device)
        check(
            cache.shape[3] == head_dim, f"{name} has head_dim {cache.shape[3]}, the {of} {head_dim}"
        )
        check(
            num_kv_heads is None or cache.shape[2] == num_kv_heads,
            f"{name} has {cache.shape[2]} KV heads, the {of} {num_kv_heads}",
        )
    check(
        value_cache.shape == key_cache.shape,
        f"value_cache has shape {tuple(value_cache.shape)}, key_cache {tuple(key_cache.shape)}",
    )
    block_size = key_cache.shape[1]
    # the smallest tensor-core K dimension (block_size is one in the p @ v product)
    check(
        block_size >= 16 and block_size & (block_size - 1) == 0,
        f"key_cache has block_size {block_size}; the kernels take a power of two >= 16",
    )
    return key_cache.shape[2]


def _check_index(name: str, t: torch.Tensor, shape: tuple[int, ...], device) -> None:
    check(t.dtype in _INDEX_DTYPES, f"{name} is {t.dtype}, expected int32 or int64")
    check(tuple(t.shape) == shape, f"{name} has shape {tuple(t.shape)}, expected {shape}")
    check(t.is_contiguous(), f"{name} must be contiguous")
    check_device(name, t, device)


def _check_block_tables(block_tables: torch.Tensor, num_seqs: int, device) -> None:
    check(
        block_tables.dtype in _INDEX_DTYPES,
        f"block_tables is {block_tables.dtype}, expected int32 or int64",
    )
    check(
        block_tables.dim() == 2 and block_tables.shape[0] == num_seqs,
        f"block_tables has shape {tuple(block_tables.shape)}, expected [{num_seqs}, max_blocks]",
    )
    check_device("block_tables", block_tables, device)


def _check_out(out: torch.Tensor | None, query: torch.Tensor) -> torch.Tensor:
    """``out`` shaped and typed as ``query`` (last dim contiguous), or a new tensor."""
    if out is None:
        return torch.empty(query.shape, dtype=query.dtype, device=query.device)
    check(
        out.shape == query.shape, f"out has shape {tuple(out.shape)}, expected {tuple(query.shape)}"
    )
    check(out.dtype == query.dtype, f"out is {out.dtype}, expected {query.dtype} (the query's)")
    check(out.stride(2) == 1, "out must be contiguous in its last dimension")
    check_device("out", out, query.device)
    return out
