"""Paged attention over the block-structured KV cache: the dispatcher, and the torch path (CPU).

``metadata.backend`` picks the path: "torch" (here, with the C++ decode and prefill kernels where
they are built) or "triton" (``kernel_ops/triton_attention.py``, on CUDA, or interpreted on the
CPU).

The KV cache of one layer is a pair of tensors ``[num_blocks, block_size, num_kv_heads, head_dim]``.
A request's tokens live in the blocks named by its row of ``block_tables``; ``slot_mapping`` gives
each new token's flat slot (``block_id * block_size + offset``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llmrpc.kernels import cpu_ops

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)  # --kv-cache-dtype fp8, fp8_e5m2
# ``cpu_ops.vector_width()``, read once: a plain int, which torch.compile takes for the constant it
# is (it cannot trace the CPU capability query behind it). Head sizes must be multiples of it.
_VECTOR_WIDTH = cpu_ops.vector_width()


@dataclass
class PrefillSeq:
    """A request with more than one new token this step (a prompt chunk)."""

    query_start: int
    query_end: int
    seq_len: int  # context length after this step, cached tokens included
    block_ids: torch.Tensor  # [num_blocks_of_seq]


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens]
    # Requests with exactly one new token are batched together:
    decode_indices: torch.Tensor  # [num_decodes] rows of the flat batch
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks]
    decode_seq_lens: torch.Tensor  # [num_decodes] int64, context length after this step
    prefills: list[PrefillSeq]
    decodes_only: bool = False  # every row of the batch is a decode row, in order
    # Rows may be padding (a CUDA graph's bucket past the step's own rows): slot -1, whose key
    # and value are not stored. The Triton store skips -1 always; the torch path where this is set.
    padded: bool = False
    backend: str = "torch"  # --attention-backend, resolved: torch or triton
    # The triton backend takes every prompt chunk in one varlen call; prefills is then empty.
    prefill_indices: torch.Tensor | None = None  # [num_prefill_tokens] rows of the flat batch
    prefill_query_start_loc: torch.Tensor | None = None  # [num_prefill_seqs + 1]
    prefill_seq_lens: torch.Tensor | None = None  # [num_prefill_seqs] context after this step
    prefill_block_tables: torch.Tensor | None = None  # [num_prefill_seqs, max_blocks]
    prefill_max_query_len: int = 0  # rows of the longest chunk (sizes the kernel's grid)
    # longrope models (Phi-3.5, Phi-4-mini): the rows whose rotary takes the long factors, as
    # their request decides (None: by position alone, as every decode row may be)
    rope_long_rows: torch.Tensor | None = None  # [num_tokens] bool
    # some row's context is longer than the model's shortest attention window (set where the
    # model has windows): only then does a window change what a row attends to
    past_window: bool = False


def write_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    metadata: AttentionMetadata,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> None:
    """Store each new token's key and value in its slot (``metadata.slot_mapping``); an fp8
    cache (``--kv-cache-dtype``) gets ``key / k_scale`` and ``value / v_scale``, rounded once."""
    if metadata.backend == "triton":
        from llmrpc.kernels import triton_ops

        triton_ops.store_kv(key, value, key_cache, value_cache, metadata.slot_mapping, *kv_scales)
        return
    if metadata.padded:  # a data-dependent selection: CUDA graphs take the Triton backend only
        keep = metadata.slot_mapping >= 0
        key, value, slots = key[keep], value[keep], metadata.slot_mapping[keep]
        store_kv_rows(key, value, key_cache, value_cache, slots, kv_scales)
        return
    store_kv_rows(key, value, key_cache, value_cache, metadata.slot_mapping, kv_scales)


def store_kv_rows(key, value, key_cache, value_cache, slot_mapping, kv_scales) -> None:
    """``write_kv``'s torch path, for slots that are all real (no -1)."""
    for rows, cache, scale in ((key, key_cache, kv_scales[0]), (value, value_cache, kv_scales[1])):
        if cache.dtype in FP8_DTYPES:  # torch has no fp8 index_copy_: copy the bytes
            rows = rows.float() * (1.0 / scale)
            # beyond the largest finite value (infinities too): the largest; a NaN stays NaN,
            # as the positive NaN 0x7F that the Triton store writes (a NaN's sign is not kept)
            largest = torch.finfo(cache.dtype).max
            rows = rows.clamp(-largest, largest).masked_fill_(rows.isnan(), float("nan"))
            rows = rows.to(cache.dtype).view(torch.uint8)
            cache = cache.view(torch.uint8)
        cache.view(-1, *rows.shape[1:]).index_copy_(0, slot_mapping, rows)


def decode_attention_qkv(
    qkv: torch.Tensor,  # [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]
    rotary: tuple[torch.Tensor, torch.Tensor],  # cos, sin: [num_tokens, 1, head_dim]
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    metadata: AttentionMetadata,
    num_heads: int,
    scale: float,
) -> torch.Tensor | None:  # [num_tokens, num_heads, head_dim]
    """A decodes-only step's rotary, KV store and attention in one call of the C++ kernel, from
    the qkv projection's rows, with the bits of ``rotary``, ``write_kv`` and ``paged_attention``
    one after another; None where that kernel does not take the step or its tensors (the caller
    runs the three). The caller answers for the layer: rotary over whole heads, no window a row's
    context reaches past, no softcap."""
    if metadata.backend != "torch" or not metadata.decodes_only or metadata.padded:
        return None
    if qkv.stride(1) != 1 or not qkv_kernel_fits(qkv, rotary, key_cache, value_cache):
        return None
    if not decode_kernel_planned(num_heads, key_cache, qkv.shape[0]):
        return None
    cos, sin = rotary
    return torch.ops.llmrpc_cpu.decode_attention_qkv.default(
        qkv, cos, sin, key_cache, value_cache, metadata.slot_mapping,
        metadata.decode_block_tables, metadata.decode_seq_lens, num_heads, scale,
    )  # fmt: skip


def read_kv(cache_rows: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Gathered cache rows in ``dtype``: an fp8 cache's as ``fp8 * scale``, rounded once."""
    if cache_rows.dtype in FP8_DTYPES:
        return (cache_rows.float() * scale).to(dtype)
    return cache_rows


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    kv_scales: tuple[float, float] = (1.0, 1.0),
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """``window``: the layer's attention window (a row at position p sees keys past p - window).
    The Triton kernels take it always (a CUDA graph replays whatever the contexts); the C++
    decode kernel takes none: where a row's context passes the window, the torch path computes
    these layers. ``softcap``: the scores soft-capped to ``softcap * tanh(s / softcap)`` before
    the softmax (Gemma 2); the Triton kernels take it, the C++ kernel does not (the torch path
    computes such layers on the CPU)."""
    if metadata.backend == "triton":
        return _triton_attention(
            query, key_cache, value_cache, metadata, scale, kv_scales, window, softcap
        )
    if not metadata.past_window:
        window = None  # no row's context reaches past it
    fits = window is None and softcap is None and decode_kernel_fits(query, key_cache, value_cache)
    rows = metadata.decode_indices
    # the decode rows' path: the C++ kernel where it fits and was not measured slower here (in
    # a step of decodes alone, counted from the query: a compiled graph that read
    # decode_indices' size would guard on it and recompile for each new batch size)
    count = query.shape[0] if metadata.decodes_only else rows.shape[0]
    cpp_decode = fits and decode_kernel_planned(query.shape[1], key_cache, count)
    kernel = "cpp-decode" if cpp_decode else "torch-sdpa"
    more = (scale, kernel, kv_scales, window, softcap)
    if metadata.decodes_only:
        return decode(query, key_cache, value_cache, metadata, *more)
    output = torch.empty_like(query)
    if rows.numel():
        output[rows] = decode(query[rows], key_cache, value_cache, metadata, *more)
    for seq in metadata.prefills:
        kernel = _planned_prefill(query, key_cache, seq) if fits else "torch-sdpa"
        prefill(
            query, key_cache, value_cache, seq, scale, output, kernel, kv_scales, window, softcap
        )
    return output


# Each attention shape's measured path by bucket of rows, for prompt chunks ("prefill", by the
# chunk's rows) and for a step's decode rows ("decode", by their number): set at model load from
# attention_tuning's measurements. A shape without a plan takes torch's path for prompt chunks
# and the C++ decode kernel for decode rows (where each fits), so a decode plan that gives the
# kernel every bucket is not kept: most steps then find no decode plan at all.
_planned: dict[str, dict[tuple, tuple[tuple[int | None, str], ...]]] = {
    "prefill": {},
    "decode": {},
}


def reset_kernels() -> None:
    """Every shape unplanned (each engine plans its own at load)."""
    for plans in _planned.values():
        plans.clear()


def set_kernels(stage: str, shape: tuple, buckets: tuple[tuple[int | None, str], ...]) -> None:
    """``stage``: "prefill" or "decode"; ``shape``: (query heads, block size, KV heads, head
    size, dtype); ``buckets``: (last row or None for no end, path) in rising order."""
    if stage == "decode" and all(kernel == "cpp-decode" for _, kernel in buckets):
        _planned[stage].pop(shape, None)  # what an unplanned shape takes
    else:
        _planned[stage][shape] = buckets


def planned_kernel(stage: str, num_heads: int, key_cache, rows: int) -> str | None:
    """The measured path of ``rows`` rows of ``stage`` for this shape, or None: not measured."""
    buckets = _planned[stage].get((num_heads, *key_cache.shape[1:], key_cache.dtype))
    if buckets is None:
        return None
    return next(kernel for last, kernel in buckets if last is None or rows <= last)


def decode_kernel_planned(num_heads: int, key_cache, rows: int) -> bool:
    """Whether ``rows`` decode rows of a step take the C++ decode kernel (which must fit) by the
    measured plan: yes but where torch's path was timed faster for their bucket. A compiled step
    holds the kernel, and the compiled forward takes no more rows than ``compiled_decode_rows``."""
    if not _planned["decode"] or torch.compiler.is_compiling():
        return True
    return planned_kernel("decode", num_heads, key_cache, rows) != "torch-sdpa"


def compiled_decode_rows() -> int | None:
    """The most decode rows a compiled step may take (None: any): the last row of the buckets,
    from one row up, whose measured decode path is the C++ kernel (0: not even one row)."""
    limits = []
    for buckets in _planned["decode"].values():
        last_cpp = 0
        for last, kernel in buckets:
            if kernel != "cpp-decode":
                limits.append(last_cpp)
                break
            last_cpp = last
    return min(limits, default=None)


def _planned_prefill(query, key_cache, seq: PrefillSeq) -> str:
    rows = seq.query_end - seq.query_start
    return planned_kernel("prefill", query.shape[1], key_cache, rows) or "torch-sdpa"  # (unplanned)


def prefill_kernel_fits(key_cache) -> bool:
    """Whether the C++ prefill kernel takes this cache's head size (where the decode kernel
    takes the shapes: ``decode_kernel_fits``)."""
    return key_cache.shape[-1] % 16 == 0


def prefill(
    query, key_cache, value_cache, seq: PrefillSeq, scale, output, kernel: str,
    kv_scales=(1.0, 1.0), window=None, softcap=None,
) -> None:  # fmt: skip
    """One prompt chunk's attention into its rows of ``output`` by ``kernel``: ``cpp-prefill``
    (the C++ kernel, which must fit: no window, softcap or fp8 cache) or ``torch-sdpa``."""
    rows = slice(seq.query_start, seq.query_end)
    if kernel == "cpp-prefill":
        output[rows] = torch.ops.llmrpc_cpu.prefill_attention.default(
            _dense_heads(query[rows]), key_cache, value_cache, seq.block_ids, seq.seq_len, scale
        )
    else:
        _prefill_attention(
            query, key_cache, value_cache, seq, scale, output, kv_scales, window, softcap
        )


def _dense_heads(query: torch.Tensor) -> torch.Tensor:
    """``query`` as the C++ kernels read it: each row's heads dense (its rows may be strided, as
    the qkv projection's are); a copy only where they are not (heads-first layouts)."""
    if query.stride(2) == 1 and query.stride(1) == query.shape[2]:
        return query
    return query.contiguous()


def _triton_attention(
    query, key_cache, value_cache, metadata, scale, kv_scales, window, softcap
) -> torch.Tensor:
    from llmrpc.kernels import triton_attention, triton_ops

    k_scale, v_scale = kv_scales
    window, softcap = window or 0, softcap or 0.0
    decode = functools.partial(
        triton_ops.decode_attention,
        key_cache=key_cache,
        value_cache=value_cache,
        block_tables=metadata.decode_block_tables,
        seq_lens=metadata.decode_seq_lens,
        scale=scale,
        k_scale=k_scale,
        v_scale=v_scale,
        window=window,
        softcap=softcap,
    )
    if metadata.decodes_only:
        return decode(query)
    output = torch.empty_like(query)
    if metadata.decode_indices.numel():
        output[metadata.decode_indices] = decode(query[metadata.decode_indices])
    rows = metadata.prefill_indices
    if rows is not None and rows.numel():
        output[rows] = triton_attention.prefill_attention(
            query[rows], key_cache, value_cache, metadata.prefill_block_tables,
            metadata.prefill_query_start_loc, metadata.prefill_seq_lens, scale,
            max_query_len=metadata.prefill_max_query_len, k_scale=k_scale, v_scale=v_scale,
            window=window, softcap=softcap,
        )  # fmt: skip
    return output


def decode(
    query, key_cache, value_cache, metadata, scale, kernel: str, kv_scales=(1.0, 1.0),
    window=None, softcap=None,
) -> torch.Tensor:  # fmt: skip
    """A step's decode rows' attention (``query``: those rows, ``[num_decodes, num_heads,
    head_dim]``) by ``kernel``: ``cpp-decode`` (the C++ kernel, which must fit: no window, softcap
    or fp8 cache) or ``torch-sdpa``."""
    if kernel == "cpp-decode":
        return torch.ops.llmrpc_cpu.decode_attention.default(
            _dense_heads(query), key_cache, value_cache, metadata.decode_block_tables,
            metadata.decode_seq_lens, scale,
        )  # fmt: skip
    return decode_attention_torch(
        query, key_cache, value_cache, metadata, scale, kv_scales, window, softcap
    )


def decode_attention_torch(
    query, key_cache, value_cache, metadata, scale, kv_scales=(1.0, 1.0), window=None, softcap=None
) -> torch.Tensor:
    """The pure-torch decode path: ``query`` is ``[num_decodes, num_heads, head_dim]``."""
    tables = metadata.decode_block_tables
    num_decodes, max_blocks = tables.shape
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    seq_lens = metadata.decode_seq_lens.view(-1, 1, 1, 1)
    first = torch.zeros_like(seq_lens)  # each row's first position gathered
    # the blocks a window can touch, from the one holding its first position
    width = max_blocks if window is None else -(-window // block_size) + 1
    if width < max_blocks:
        start = ((seq_lens - window).clamp(min=0) // block_size).clamp(max=max_blocks - width)
        columns = start.view(-1, 1) + torch.arange(width, device=tables.device)
        tables, max_blocks, first = tables.gather(1, columns), width, start * block_size
    # [num_decodes, num_kv_heads, max_blocks * block_size, head_dim]; index_select copies whole
    # blocks (advanced indexing, key_cache[tables], took 6x as long at 32 sequences)
    flat = tables.view(-1)
    keys = read_kv(key_cache.index_select(0, flat), kv_scales[0], query.dtype)
    values = read_kv(value_cache.index_select(0, flat), kv_scales[1], query.dtype)
    keys = keys.view(num_decodes, -1, num_kv_heads, head_dim)
    values = values.view(num_decodes, -1, num_kv_heads, head_dim)
    keys, values = keys.transpose(1, 2), values.transpose(1, 2)
    # Query heads sharing a KV head become rows of one attention problem (grouped-query
    # attention without repeating keys): [num_decodes, num_kv_heads, group, head_dim].
    q = query.view(num_decodes, num_kv_heads, -1, head_dim)
    # True = attend: each row's positions up to its length (padding blocks point at block 0),
    # and within a window the last ``window`` of them
    positions = first + torch.arange(max_blocks * block_size, device=query.device)
    mask = positions < seq_lens
    if window is not None:
        mask &= positions >= seq_lens - window
    out = _attend(q, keys, values, mask, scale, softcap)
    return out.reshape(num_decodes, -1, head_dim)


def _attend(q, k, v, mask, scale, softcap, enable_gqa=False) -> torch.Tensor:
    """Attention of ``q`` over ``k``/``v`` where ``mask`` is True: SDPA; with ``softcap``,
    written out (SDPA has no cap) in float32, the scores capped as Transformers' Gemma 2 caps
    them, ``q`` grouped by KV head for grouped-query attention."""
    if softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa
        )
    *lead, heads, rows, head_dim = q.shape
    kv_heads = k.shape[-3]
    grouped = q.reshape(*lead, kv_heads, heads // kv_heads, rows, head_dim).float()
    k, v = k.unsqueeze(-3).float(), v.unsqueeze(-3).float()
    scores = grouped @ k.transpose(-1, -2) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask.unsqueeze(-3), float("-inf"))
    out = scores.softmax(-1) @ v
    return out.reshape(q.shape).to(q.dtype)


def decode_kernel_fits(query, key_cache, value_cache) -> bool:
    """Whether the C++ decode kernel (kernel_ops/csrc, loaded at model load) takes these shapes
    (``query``: the query heads, or the qkv rows they are part of)."""
    if not cpu_ops.loaded() or query.device.type != "cpu":
        return False
    head_dim = key_cache.shape[-1]
    return (
        key_cache.dtype == query.dtype  # not an fp8 cache
        and head_dim % _VECTOR_WIDTH == 0
        and head_dim <= 256
        and key_cache.is_contiguous()
        and value_cache.is_contiguous()
    )


def qkv_kernel_fits(x, rotary, key_cache, value_cache) -> bool:
    """Whether ``decode_attention_qkv`` takes rows of ``x``'s dtype and device (the qkv rows, or
    the hidden rows they come from), with ``rotary``'s cos and sin, and these caches."""
    cos, sin = rotary
    return (
        decode_kernel_fits(x, key_cache, value_cache)
        and cos.dtype == x.dtype
        and cos.is_contiguous()
        and sin.is_contiguous()
    )


def _prefill_attention(
    query,
    key_cache,
    value_cache,
    seq: PrefillSeq,
    scale,
    output,
    kv_scales,
    window=None,
    softcap=None,
) -> None:
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    num_queries = seq.query_end - seq.query_start
    offset = seq.seq_len - num_queries  # query i sits at position offset + i
    # the blocks from the one holding the first query's first key in the window (all without)
    first_block = 0 if window is None else max(offset - window + 1, 0) // block_size
    block_ids = seq.block_ids[first_block:]
    keys = read_kv(key_cache.index_select(0, block_ids), kv_scales[0], query.dtype)
    values = read_kv(value_cache.index_select(0, block_ids), kv_scales[1], query.dtype)
    first = first_block * block_size  # the position of the first key read
    keys = keys.view(-1, num_kv_heads, head_dim)[: seq.seq_len - first]
    values = values.view(-1, num_kv_heads, head_dim)[: seq.seq_len - first]
    q = query[seq.query_start : seq.query_end].transpose(0, 1).unsqueeze(0)
    k = keys.transpose(0, 1).unsqueeze(0)
    v = values.transpose(0, 1).unsqueeze(0)
    if num_queries == seq.seq_len and window is None and softcap is None:  # plain causal
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:  # each query sees the keys up to its own position
        rows = torch.arange(num_queries, device=query.device).unsqueeze(1) + offset
        keys_at = torch.arange(first, seq.seq_len, device=query.device).unsqueeze(0)
        mask = keys_at <= rows
        if window is not None:  # and past the last ``window`` positions
            mask &= keys_at > rows - window
        out = _attend(q, k, v, mask, scale, softcap, enable_gqa=True)
    output[seq.query_start : seq.query_end] = out.squeeze(0).transpose(0, 1)
