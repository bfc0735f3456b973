"""The Triton attention kernels (kernel_ops/triton_attention.py) against their torch twins.

Without a GPU they run in Triton's CPU interpreter (tests/conftest.py sets TRITON_INTERPRET=1);
``TestCuda`` runs the same checks natively where a CUDA device is present. Every kernel output
buffer starts as NaN, and every cache slot that holds no position of a sequence (the tail of a
sequence's last block, spare blocks, the padding entries of block tables) is NaN: the kernels
must neither skip an output element nor let a masked-out position contribute.
"""

from __future__ import annotations

import math

import pytest
import torch
from triton_compile_keys import recorded_compile_keys

from llmrpc.kernels import triton_attention as ta
from llmrpc.kernels.triton_utils import interpreting

# Outputs are averages of N(0, 1) values (|x| < 4): the twin and the kernel each round once to
# the dtype at the end, and the kernel's probabilities are rounded to 16 bits for the p @ v dot.
TOLERANCE = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float16: dict(rtol=2e-3, atol=2e-3),
    torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
}
DTYPES = [pytest.param(dtype, id=str(dtype).removeprefix("torch.")) for dtype in TOLERANCE]
# (block_size, head_dim, num_heads, num_kv_heads, index dtype of tables, lengths, offsets)
LAYOUTS = [
    pytest.param((16, 64, 4, 2, torch.int32), id="bs16-d64-gqa4/2"),
    pytest.param((32, 128, 4, 1, torch.int64), id="bs32-d128-mqa4/1"),
    pytest.param((16, 128, 2, 2, torch.int64), id="bs16-d128-mha2/2"),
    pytest.param((32, 64, 2, 2, torch.int32), id="bs32-d64-mha2/2"),
    pytest.param((16, 96, 4, 1, torch.int32), id="bs16-d96-mqa4/1"),  # head_dim padded to 128
    pytest.param((32, 80, 6, 2, torch.int64), id="bs32-d80-gqa6/2"),  # a group of 3
]
GQA = (16, 64, 4, 2, torch.int32)
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
SCALE = 0.125
NAN = float("nan")


def make_cache(seq_lens, block_size, num_kv_heads, head_dim, dtype, device, seed=0):
    """Key and value caches and block tables for sequences of ``seq_lens`` tokens: each
    sequence's blocks are scattered over the cache (a random permutation), positions it holds are
    N(0, 1) and every other slot NaN; tables are padded with a spare (NaN) block's id."""
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(needed) + 2
    order = torch.randperm(num_blocks, generator=gen)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache, value_cache = torch.full(shape, NAN), torch.full(shape, NAN)
    tables = torch.full((len(seq_lens), max(needed) + 1), int(order[-1]))
    first = 0
    for s, (length, count) in enumerate(zip(seq_lens, needed, strict=True)):
        blocks = order[first : first + count]
        first += count
        tables[s, :count] = blocks
        slots = (blocks[:, None] * block_size + torch.arange(block_size)).flatten()[:length]
        for cache in (key_cache, value_cache):
            cache.view(-1, num_kv_heads, head_dim)[slots] = torch.randn(
                length, num_kv_heads, head_dim, generator=gen
            )
    return key_cache.to(device, dtype), value_cache.to(device, dtype), tables.to(device)


def make_query(num_tokens, num_heads, num_kv_heads, head_dim, dtype, device, seed=1):
    """A query ``[num_tokens, num_heads, head_dim]`` viewed out of a fused qkv projection
    (strided rows, as the model hands it over)."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=gen)
    return qkv.to(device, dtype)[:, :num_heads]


def poisoned_like(t: torch.Tensor) -> torch.Tensor:
    return torch.full(t.shape, NAN, dtype=t.dtype, device=t.device)


def assert_matches(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert not actual.isnan().any(), "the kernel left or produced NaN"
    torch.testing.assert_close(actual, expected, **TOLERANCE[expected.dtype])


def _not_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(0, -1).contiguous().transpose(0, -1)


# decode_attention arguments -> what a test replaces, and the error it expects
CONTRACT_CASES = [
    (lambda a: {"query": a["query"].half()}, "key_cache is torch.float32, expected torch.float16"),
    (lambda a: {"value_cache": _not_contiguous(a["value_cache"])}, "value_cache must be contig"),
    (lambda a: {"query": a["query"][:, :3]}, "query has 3 heads, not a multiple"),
    (lambda a: {"query": _not_contiguous(a["query"])}, "query must be contiguous in its last"),
    (lambda a: {"block_tables": a["block_tables"].float()}, "block_tables is torch.float32"),
    (lambda a: {"block_tables": a["block_tables"][:1]}, "block_tables has shape"),
    (lambda a: {"seq_lens": a["seq_lens"].short()}, "seq_lens is torch.int16"),
    (lambda a: {"seq_lens": a["seq_lens"][:1]}, "seq_lens has shape"),
    (lambda a: {"out": a["query"].half()}, "out is torch.float16"),
    (
        lambda a: {name: a[name][:, :8].contiguous() for name in ("key_cache", "value_cache")},
        "key_cache has block_size 8",
    ),
]


class KernelChecks:
    """The checks, run by each subclass on its ``device``."""

    device: str

    # ---- store_kv

    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize(
        "block_size, num_kv_heads, head_dim, slot_dtype",
        [(16, 2, 64, torch.int32), (32, 1, 96, torch.int64)],
    )
    def test_store_kv(self, dtype, block_size, num_kv_heads, head_dim, slot_dtype):
        gen = torch.Generator().manual_seed(2)
        num_blocks, num_tokens, num_heads = 6, 11, 2 * num_kv_heads
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        key_cache = torch.randn(shape, generator=gen).to(self.device, dtype)
        value_cache = torch.randn(shape, generator=gen).to(self.device, dtype)
        # key and value are views of a fused qkv row, as the model produces them
        qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=gen)
        qkv = qkv.to(self.device, dtype)
        key = qkv[:, num_heads : num_heads + num_kv_heads]
        value = qkv[:, num_heads + num_kv_heads :]
        slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
        slots[[0, 4, 10]] = -1  # padding rows
        slots = slots.to(self.device, slot_dtype)

        original = key_cache.clone()
        expected_k, expected_v = key_cache.clone(), value_cache.clone()
        ta.store_kv_torch(key, value, expected_k, expected_v, slots)
        ta.store_kv(key, value, key_cache, value_cache, slots)
        assert torch.equal(key_cache, expected_k) and torch.equal(value_cache, expected_v)
        # and directly: written rows hold key's bits, every other slot (-1 rows') its old data
        flat = key_cache.view(-1, num_kv_heads, head_dim)
        kept = slots >= 0
        assert torch.equal(flat[slots[kept].long()], key[kept])
        untouched = torch.ones(flat.shape[0], dtype=torch.bool, device=self.device)
        untouched[slots[kept].long()] = False
        assert torch.equal(flat[untouched], original.view_as(flat)[untouched])

    # ---- decode_attention

    def decode_case(self, seq_lens, layout, dtype):
        block_size, head_dim, num_heads, num_kv_heads, index_dtype = layout
        key_cache, value_cache, tables = make_cache(
            seq_lens, block_size, num_kv_heads, head_dim, dtype, self.device
        )
        query = make_query(len(seq_lens), num_heads, num_kv_heads, head_dim, dtype, self.device)
        lens = torch.tensor(seq_lens, dtype=index_dtype, device=self.device)
        return query, key_cache, value_cache, tables.to(index_dtype), lens

    def run_decode(self, args, **kwargs) -> torch.Tensor:
        out = poisoned_like(args[0])
        result = ta.decode_attention(*args, SCALE, out=out, **kwargs)
        assert result is out
        return result

    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("layout", LAYOUTS)
    def test_decode(self, dtype, layout):
        args = self.decode_case([1, 19, 70], layout, dtype)
        assert_matches(self.run_decode(args), ta.decode_attention_torch(*args, SCALE))

    @pytest.mark.parametrize("dtype", DTYPES)
    def test_decode_splits(self, dtype):
        """Forced split counts (7 leaves the short sequences empty splits) match one split."""
        args = self.decode_case([300, 77, 5, 129], GQA, dtype)
        expected = ta.decode_attention_torch(*args, SCALE)
        one_split = self.run_decode(args, num_splits=1)
        assert_matches(one_split, expected)
        for num_splits in (3, 7):
            split = self.run_decode(args, num_splits=num_splits)
            assert_matches(split, expected)
            assert_matches(split, one_split)

    def test_decode_default_splits(self):
        """Two sequences of one KV head, a table 36 blocks of 32 wide (1152 tokens): as many
        splits by default as fill two waves of the device's SMs (4 in the interpreter: 4 splits),
        up to one per loop iteration (one 32-token block)."""
        args = self.decode_case([1100, 40], (32, 64, 4, 1, torch.int64), torch.float16)
        device = torch.device(self.device)
        splits = ta.default_num_splits(2, 1, args[3].shape[1], 32, device)
        assert splits == min(36, -(-2 * ta.multiprocessor_count(device) // 2))
        expected = ta.decode_attention_torch(*args, SCALE)
        assert_matches(self.run_decode(args), expected)
        assert_matches(self.run_decode(args, num_splits=1), expected)

    def test_decode_many_splits(self):
        """16-token blocks, 2 a loop iteration, a table 70 blocks wide: 5 splits (of 14
        blocks), 18 (of 4: more splits than the reduce kernel combines at once, 16) and 200
        (35 of one iteration: every split has blocks to read); the short sequences leave all
        but their first split empty."""
        args = self.decode_case([1100, 40, 3], GQA, torch.float32)
        expected = ta.decode_attention_torch(*args, SCALE)
        for num_splits in (5, 18, 200):
            assert_matches(self.run_decode(args, num_splits=num_splits), expected)

    @pytest.mark.parametrize("window", [1, 20, 47])
    def test_decode_window(self, window):
        """A window of the last 1, 20 or 47 positions: the splits before it are empty, and one
        split or several give the twin's result, which differs from full attention."""
        args = self.decode_case([300, 77, 5, 129], GQA, torch.float32)
        expected = ta.decode_attention_torch(*args, SCALE, window=window)
        for num_splits in (1, 3, 7):
            assert_matches(self.run_decode(args, num_splits=num_splits, window=window), expected)
        assert not torch.allclose(expected[0], ta.decode_attention_torch(*args, SCALE)[0])

    @pytest.mark.parametrize("dtype", DTYPES)
    def test_decode_softcap(self, dtype):
        """Scores capped at 0.5 (Gemma 2's soft-capping, far below these scores' spread), one
        split or several, alone and with a window: the twin's result, not the uncapped one."""
        args = self.decode_case([300, 77, 5, 129], GQA, dtype)
        for window in (0, 47):
            expected = ta.decode_attention_torch(*args, SCALE, window=window, softcap=0.5)
            for num_splits in (1, 3):
                got = self.run_decode(args, num_splits=num_splits, window=window, softcap=0.5)
                assert_matches(got, expected)
        uncapped = ta.decode_attention_torch(*args, SCALE)
        assert not torch.allclose(expected.float(), uncapped.float(), atol=1e-2)

    # ---- prefill_attention

    def run_prefill(self, batch, layout, dtype, **kwargs):
        block_size, head_dim, num_heads, num_kv_heads, index_dtype = layout
        """``batch`` is (new tokens, context length after the step) per sequence."""
        num_q = [q for q, _ in batch]
        seq_lens = [n for _, n in batch]
        key_cache, value_cache, tables = make_cache(
            seq_lens, block_size, num_kv_heads, head_dim, dtype, self.device
        )
        query = make_query(sum(num_q), num_heads, num_kv_heads, head_dim, dtype, self.device)
        starts = torch.tensor([0, *num_q], dtype=index_dtype).cumsum(0, dtype=index_dtype)
        lens = torch.tensor(seq_lens, dtype=index_dtype, device=self.device)
        args = (query, key_cache, value_cache, tables.to(index_dtype), starts.to(self.device), lens)
        out = poisoned_like(query)
        result = ta.prefill_attention(*args, SCALE, out=out, **kwargs)
        assert result is out
        window, softcap = kwargs.get("window", 0), kwargs.get("softcap", 0.0)
        expected = ta.prefill_attention_torch(*args, SCALE, window=window, softcap=softcap)
        assert_matches(result, expected)
        return args

    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("layout", LAYOUTS)
    def test_prefill(self, dtype, layout):
        # a whole prompt, one token after a cached prefix, a chunk after a cached prefix, and a
        # prompt of several (token, head) tiles
        batch = [(9, 9), (1, 23), (21, 50), (40, 40)]
        self.run_prefill(batch, layout, dtype)

    @pytest.mark.parametrize("dtype", DTYPES)
    def test_prefill_long(self, dtype):
        batch = [(150, 300), (3, 3)]
        self.run_prefill(batch, GQA, dtype, max_query_len=150)

    @pytest.mark.parametrize("window", [1, 16, 37])
    def test_prefill_window(self, window):
        """Each query over the last ``window`` positions up to its own, in tiles whose rows start
        their windows in different blocks (rows that see nothing of the tile's first blocks)."""
        batch = [(9, 9), (1, 23), (21, 50), (40, 40), (150, 300)]
        args = self.run_prefill(batch, GQA, torch.float32, window=window, max_query_len=150)
        full = ta.prefill_attention_torch(*args, SCALE)
        assert not torch.allclose(full, ta.prefill_attention_torch(*args, SCALE, window=window))

    @pytest.mark.parametrize("dtype", DTYPES)
    def test_prefill_softcap(self, dtype):
        batch = [(9, 9), (21, 50), (150, 300)]
        args = self.run_prefill(batch, GQA, dtype, softcap=0.5, max_query_len=150)
        self.run_prefill(batch, GQA, dtype, softcap=0.5, window=16, max_query_len=150)
        capped = ta.prefill_attention_torch(*args, SCALE, softcap=0.5)
        uncapped = ta.prefill_attention_torch(*args, SCALE)
        assert not torch.allclose(capped.float(), uncapped.float(), atol=1e-2)

    @pytest.mark.parametrize("dtype", DTYPES)
    def test_prefill_one_token_each(self, dtype):
        """Decode-shaped rows through the prefill kernel (its smallest tile)."""
        self.run_prefill([(1, 7), (1, 40), (1, 1)], (32, 64, 2, 1, torch.int64), dtype)

    # ---- an fp8 KV cache (--kv-cache-dtype)

    @pytest.mark.parametrize("fp8", FP8, ids=["e4m3", "e5m2"])
    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
    def test_fp8_cache(self, fp8, dtype):
        """Stores round ``key / k_scale`` to fp8 exactly as the twin does (the same bytes), and
        both attention kernels read ``fp8 * scale`` as their twins do."""
        k_scale, v_scale = 0.5, 2.0
        seq_lens = [1, 37, 90]
        key_cache, value_cache, tables = make_cache(seq_lens, 16, 2, 64, dtype, self.device)
        key_cache = (key_cache.float() / k_scale).to(fp8)  # NaN slots stay NaN
        value_cache = (value_cache.float() / v_scale).to(fp8)
        scales = {"k_scale": k_scale, "v_scale": v_scale}
        # store: a token to each sequence's next slot (one of them a padding row)
        slots = torch.tensor([5, -1, 7 * 16 + 3], device=self.device)
        new = make_query(3, 2, 2, 64, dtype, self.device, seed=4)
        stored_k, stored_v = key_cache.clone(), value_cache.clone()
        twin_k, twin_v = key_cache.clone(), value_cache.clone()
        ta.store_kv(new, new * 3, stored_k, stored_v, slots, **scales)
        ta.store_kv_torch(new, new * 3, twin_k, twin_v, slots, **scales)
        for stored, twin in ((stored_k, twin_k), (stored_v, twin_v)):
            assert torch.equal(stored.view(torch.uint8), twin.view(torch.uint8))
        # decode and prefill over the fp8 cache
        query = make_query(3, 4, 2, 64, dtype, self.device)
        lens = torch.tensor(seq_lens, device=self.device)
        args = (query, key_cache, value_cache, tables, lens)
        out = poisoned_like(query)
        result = ta.decode_attention(*args, SCALE, out=out, **scales)
        assert_matches(result, ta.decode_attention_torch(*args, SCALE, **scales))
        starts = torch.tensor([0, 1, 2, 3], device=self.device)
        args = (query, key_cache, value_cache, tables, starts, lens)
        result = ta.prefill_attention(*args, SCALE, out=poisoned_like(query), **scales)
        assert_matches(result, ta.prefill_attention_torch(*args, SCALE, **scales))

    @pytest.mark.parametrize(
        "fp8, largest", [(FP8[0], 1000.0), (FP8[1], 1e5)], ids=["e4m3", "e5m2"]
    )
    def test_fp8_store_rounds_as_torch_over_the_whole_range(self, fp8, largest):
        """Magnitudes from 1e-7 (below the subnormals: signed zeros) to twice the largest finite
        (stored as the largest), both signs: the kernel rounds to nearest even as torch does,
        byte for byte."""
        gen = torch.Generator().manual_seed(0)
        exponents = torch.rand(4096, generator=gen) * math.log(largest / 1e-7) + math.log(1e-7)
        signs = torch.randn(4096, generator=gen).sign()
        values = (exponents.exp() * signs).view(32, 2, 64).to(self.device)
        stored = torch.zeros(3, 16, 2, 64, dtype=fp8, device=self.device)
        twin = stored.clone()
        slots = torch.arange(32, device=self.device)
        ta.store_kv(values, values, stored, stored.clone(), slots)
        ta.store_kv_torch(values, values, twin, twin.clone(), slots)
        assert torch.equal(stored.view(torch.uint8), twin.view(torch.uint8))
        assert stored.float().abs().max() == torch.finfo(fp8).max  # clamped, never NaN

    @pytest.mark.parametrize("fp8", FP8, ids=["e4m3", "e5m2"])
    def test_fp8_store_keeps_nan_and_saturates_inf(self, fp8):
        """A NaN key or value stays NaN in an fp8 cache, on the Triton path and the torch path
        alike, in the same byte (a model's fault shows in its output, not as a finite value);
        ±inf, like any value beyond the range, is stored as ±largest; the rest as before."""
        gen = torch.Generator().manual_seed(3)
        key = torch.randn(4, 2, 64, generator=gen)
        specials = torch.tensor([NAN, -NAN, math.inf, -math.inf, 1e9, -1e9])
        key.view(-1)[torch.randperm(key.numel(), generator=gen)[:60]] = specials.repeat(10)
        key, value = key.to(self.device), key.flip(0).to(self.device)
        slots = torch.tensor([3, 17, 0, 30], device=self.device)
        largest = torch.finfo(fp8).max
        stored = {}
        for store in (ta.store_kv, ta.store_kv_torch):
            caches = [torch.zeros(2, 16, 2, 64, dtype=fp8, device=self.device) for _ in range(2)]
            store(key, value, *caches, slots, k_scale=0.5, v_scale=2.0)
            stored[store] = [cache.view(-1, 2, 64)[slots.long()] for cache in caches]
            for given, rows, scale in zip((key, value), stored[store], (0.5, 2.0), strict=True):
                rows, finite = rows.float(), ~given.isnan()
                assert torch.equal(rows.isnan(), given.isnan()), store.__name__
                expected = (given / scale).clamp(-largest, largest).to(fp8).float()
                assert torch.equal(rows[finite], expected[finite]), store.__name__
                assert (rows[given.isinf()].abs() == largest).all()
        for triton_rows, torch_rows in zip(*stored.values(), strict=True):
            assert torch.equal(triton_rows.view(torch.uint8), torch_rows.view(torch.uint8))

    # ---- layout contract

    def decode_args(self, **changes) -> dict:
        names = ("query", "key_cache", "value_cache", "block_tables", "seq_lens")
        case = self.decode_case([5, 20], GQA, torch.float32)
        return {**dict(zip(names, case, strict=True)), "scale": SCALE, **changes}

    @pytest.mark.parametrize(
        "change, match", CONTRACT_CASES, ids=[match for _, match in CONTRACT_CASES]
    )
    def test_decode_contract(self, change, match):
        args = self.decode_args()
        args.update(change(args))
        with pytest.raises(ValueError, match=match):
            ta.decode_attention(**args)

    def test_prefill_contract(self):
        args = self.decode_args()
        starts = torch.tensor([0, 1, 2], device=self.device)
        with pytest.raises(ValueError, match="query_start_loc is torch.float32"):
            ta.prefill_attention(**args, query_start_loc=starts.float())
        with pytest.raises(ValueError, match="query_start_loc has shape"):
            ta.prefill_attention(**args, query_start_loc=starts[:2])
        with pytest.raises(ValueError, match="query has 3 heads, not a multiple"):
            ta.prefill_attention(**{**args, "query": args["query"][:, :3]}, query_start_loc=starts)

    def test_store_kv_contract(self):
        args = self.decode_args()
        key = torch.randn(3, 2, 64, device=self.device)
        slots = torch.tensor([0, 1, -1], device=self.device)
        caches = args["key_cache"], args["value_cache"]
        with pytest.raises(ValueError, match="key_cache has 2 KV heads, the key 3"):
            ta.store_kv(key[:, :1].expand(3, 3, 64), key[:, :1].expand(3, 3, 64), *caches, slots)
        with pytest.raises(ValueError, match="slot_mapping is torch.float32"):
            ta.store_kv(key, key, *caches, slots.float())
        with pytest.raises(ValueError, match="key_cache is torch.float32, expected torch.bfloat16"):
            ta.store_kv(key.bfloat16(), key.bfloat16(), *caches, slots)


@pytest.mark.skipif(not interpreting(), reason="Triton runs on the CPU only in its interpreter")
class TestInterpreted(KernelChecks):
    device = "cpu"

    # ---- what a GPU compiles: one variant for steps of any batch, context and split count
    # (each new variant is a JIT compile on the request path; triton_compile_keys finds them)

    def test_decode_compiles_one_variant_of_each_kernel(self):
        """Decode steps of 1 to 3 sequences, tables 1 to 39 blocks wide (1, 16 and 17 among
        them: Triton specialises an integer on 1 and on multiples of 16), 1 to 7 splits."""
        cases = [([5], 1, None), ([240, 3], None, None), ([250, 40, 5], None, 3)]
        cases += [([300, 77], None, 7), ([600], None, None), ([257], 17, 2)]
        with recorded_compile_keys() as keys:
            for seq_lens, width, num_splits in cases:
                query, *caches, tables, lens = self.decode_case(seq_lens, GQA, torch.float32)
                args = (query, *caches, tables[:, :width].contiguous(), lens)
                result = self.run_decode(args, num_splits=num_splits)
                assert_matches(result, ta.decode_attention_torch(*args, SCALE))
        assert {name: len(found) for name, found in keys.items()} == {
            "_decode_split_kernel": 1,
            "_decode_reduce_kernel": 1,
        }

    def test_store_and_prefill_compile_one_variant_per_tile(self):
        """Stores of 1, 16 and 17 tokens; prefills over tables 2, 16 and 17 blocks wide, whose
        longest chunk (times the group of 2) picks a tile of 16, 32 or 64 rows: one variant
        per tile."""
        with recorded_compile_keys() as keys:
            for num_tokens in (1, 16, 17):
                rows = torch.randn(num_tokens, 2, 64)
                caches = [torch.zeros(4, 16, 2, 64) for _ in range(2)]
                ta.store_kv(rows, rows, *caches, torch.arange(num_tokens))
            for batch in ([(1, 16)], [(9, 250)], [(40, 240)], [(3, 5), (40, 256)]):
                self.run_prefill(batch, GQA, torch.float32)
        assert {name: len(found) for name, found in keys.items()} == {
            "_store_kv_kernel": 1,
            "_prefill_kernel": 3,
        }


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
class TestCuda(KernelChecks):
    device = "cuda"


def test_default_splits_fill_two_waves_of_an_h200(monkeypatch):
    """The split count for a device of 132 SMs (an H200): the fewest splits that make at least
    264 programs (sequences x KV heads x splits), at most 256 and at most one per loop
    iteration (two 16-token blocks)."""
    monkeypatch.setattr(ta, "_cuda_multiprocessors", lambda index: 132)
    h200 = torch.device("cuda", 0)
    blocks_32k = 32768 // 16
    assert ta.default_num_splits(1, 8, blocks_32k, 16, h200) == 33  # 264 programs
    assert ta.default_num_splits(4, 8, blocks_32k, 16, h200) == 9  # 288
    assert ta.default_num_splits(64, 8, 4096 // 16, 16, h200) == 1  # 512 already
    assert ta.default_num_splits(1, 1, blocks_32k, 16, h200) == 256  # at most 256
    assert ta.default_num_splits(1, 8, 10, 16, h200) == 5  # 10 blocks: 5 iterations
    assert ta.default_num_splits(2, 8, 2, 16, h200) == 1
