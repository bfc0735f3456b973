"""The attention paths of prompt chunks and of a step's decode rows, chosen by timing here
(kernel_ops/attention_tuning.py), and the dispatch that follows the choice."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch

from llmrpc.kernels import attention, attention_tuning, cpu_ops, linear_tuning
from llmrpc.kernels.attention import AttentionMetadata

SHAPE = (8, 16, 2, 64, torch.bfloat16)  # query heads, block size, KV heads, head size, dtype


@pytest.fixture(scope="module", autouse=True)
def kernels():
    assert cpu_ops.load(), "the C++ kernels did not build on this machine (see the log)"


@pytest.fixture(autouse=True)
def unplanned():
    attention.reset_kernels()
    yield
    attention.reset_kernels()


def test_each_bucket_takes_its_fastest_path_and_an_untimed_one_the_last_choice():
    times = {
        "cpp-prefill": [None, 5.0, 9.0, 30.0, None, None],
        "torch-sdpa": [None, 4.0, 12.0, 90.0, None, None],
    }
    choice = attention_tuning.choose("prefill", "shape", 30, times)
    assert choice.kernels == (
        "torch-sdpa", "torch-sdpa", "cpp-prefill", "cpp-prefill", "cpp-prefill", "cpp-prefill",
    )  # fmt: skip
    assert "2-8 rows torch-sdpa 4 us" in choice.describe()
    assert "129-1024 rows cpp-prefill (untimed)" in choice.describe()
    assert "1 rows" not in choice.describe()  # a prompt chunk's plan starts at two rows
    # decode rows: from one row; nothing timed takes the C++ kernel, as an unplanned shape does
    times = {"cpp-decode": [None] * 6, "torch-sdpa": [None] * 6}
    assert attention_tuning.choose("decode", "shape", 30, times).kernels == ("cpp-decode",) * 6
    # torch's path takes a bucket from the kernel where it took under DECODE_EDGE of its time
    times = {
        "cpp-decode": [3.0, 9.0, 10.0, None, None, None],
        "torch-sdpa": [4.0, 7.0, 8.5, None, None, None],
    }
    choice = attention_tuning.choose("decode", "shape", 30, times)
    assert attention_tuning.DECODE_EDGE == 0.8  # (7 < 0.8 x 9; 8.5 > 0.8 x 10)
    assert choice.kernels == ("cpp-decode", "torch-sdpa") + ("cpp-decode",) * 4
    assert choice.describe().startswith(
        "decode attention shape (30 layers): 1 rows cpp-decode 3 us, 2-8 rows torch-sdpa 7 us, "
        "9-32 rows cpp-decode 10 us"
    )


def test_a_shape_the_kernels_cannot_take_has_torchs_path_alone():
    fits = attention_tuning.Shape(*SHAPE)
    assert attention_tuning.candidates(fits, "prefill") == ["cpp-prefill", "torch-sdpa"]
    assert attention_tuning.candidates(fits, "decode") == ["cpp-decode", "torch-sdpa"]
    narrow = attention_tuning.Shape(8, 16, 2, 40, torch.bfloat16)  # a head size both refuse
    assert attention_tuning.candidates(narrow, "prefill") == ["torch-sdpa"]
    assert attention_tuning.candidates(narrow, "decode") == ["torch-sdpa"]


def test_the_plan_times_both_paths_of_both_stages_and_sets_what_rows_take(tmp_path, caplog):
    caches = [(torch.zeros(4, 16, 2, 64).bfloat16(),) * 2 for _ in range(3)]
    with caplog.at_level("INFO", logger="llmrpc.kernels.attention_tuning"):
        plan = attention_tuning.plan_attention(8, caches, tmp_path)
    prefill = plan["prefill attention 8/2x64 heads, blocks of 16, bfloat16"]
    decode = plan["decode attention 8/2x64 heads, blocks of 16, bfloat16"]
    assert len(plan) == 2 and prefill.num_layers == decode.num_layers == 3
    edge = {"cpp-decode": attention_tuning.DECODE_EDGE}
    for choice, timed_buckets in ((prefill, range(1, 6)), (decode, range(5))):
        for index in timed_buckets:  # every timed bucket: the faster path (the kernel's edge)
            timed = {k: t[index] * edge.get(k, 1.0) for k, t in choice.times_us.items()}
            assert choice.kernels[index] == min(timed, key=timed.get)
    # past 1024 decode rows nothing is timed: the 129-1024 bucket's choice
    assert set(decode.times_us) == {"cpp-decode", "torch-sdpa"}
    assert all(times[5] is None for times in decode.times_us.values())
    assert decode.kernels[5] == decode.kernels[4]
    assert "attention kernels: prefill attention 8/2x64" in caplog.text
    assert "attention kernels: decode attention 8/2x64" in caplog.text
    query, key_cache = torch.zeros(300, 8, 64).bfloat16(), caches[0][0]
    for rows, index in ((2, 1), (300, 4)):
        seq = attention.PrefillSeq(0, rows, 1000, torch.arange(63))
        assert attention._planned_prefill(query, key_cache, seq) == prefill.kernels[index]
    for rows, index in ((1, 0), (5, 1), (100, 3), (5000, 5)):
        taken = attention.decode_kernel_planned(8, key_cache, rows)
        assert taken == (decode.kernels[index] == "cpp-decode"), rows
    # a second start reads the measurement back
    caplog.clear()
    with caplog.at_level("INFO", logger="llmrpc.kernels.linear_tuning"):
        again = attention_tuning.plan_attention(8, caches, tmp_path)
    assert again == plan and "timed attention" not in caplog.text
    # --batch-invariant plans prompt chunks alone: decode rows keep the C++ kernel
    attention.reset_kernels()
    assert list(attention_tuning.plan_attention(8, caches, tmp_path, ("prefill",))) == [
        "prefill attention 8/2x64 heads, blocks of 16, bfloat16"
    ]
    assert attention.decode_kernel_planned(8, key_cache, 100)


@pytest.mark.parametrize("stage", ["prefill", "decode"])
def test_the_timing_stops_at_its_deadline(stage):
    shape = attention_tuning.Shape(*SHAPE)
    ticks = iter(range(100))
    kernels = attention_tuning.candidates(shape, stage)
    times, short = attention_tuning.time_shape(
        shape, stage, kernels, deadline=0.5, clock=lambda: next(ticks)
    )
    assert short  # the clock passed the deadline after the first bucket timed
    first = 1 if stage == "prefill" else 0  # 2-8 rows, 1 row
    for path in kernels:
        assert times[path][:first] == [None] * first and times[path][first + 1 :] == [None] * (
            5 - first
        )
        assert times[path][first] > 0


def test_large_shapes_are_timed_at_fewer_rows_within_a_bounded_cache(monkeypatch):
    """A decode bucket whose call would read more than DECODE_BYTES of keys is timed at fewer
    rows (never under its first), its rows' blocks drawn from at most DECODE_BYTES of cache;
    a prompt chunk's bucket past PREFILL_FLOP likewise (here a small bound stands in for a
    large model's heads)."""
    shape = attention_tuning.Shape(*SHAPE)  # 2x64 bfloat16 KV heads: 4 KiB a block of 16
    monkeypatch.setattr(attention_tuning, "DECODE_BYTES", 40 * 32 * 4096)  # 40 rows of 512
    monkeypatch.setattr(attention_tuning, "PREFILL_FLOP", 4 * 700 * 1024 * 8 * 64)
    seen = []

    def decode(query, key_cache, value_cache, metadata, scale, kernel):
        tables = metadata.decode_block_tables
        seen.append((key_cache.shape[0], *tables.shape, len(set(tables.view(-1).tolist()))))

    def prefill(query, key_cache, value_cache, seq, scale, output, kernel):
        seen.append((seq.query_end - seq.query_start, seq.seq_len))

    monkeypatch.setattr(attention, "decode", decode)
    monkeypatch.setattr(attention, "prefill", prefill)
    times, short = attention_tuning.time_shape(
        shape, "decode", ["cpp-decode", "torch-sdpa"], deadline=float("inf")
    )
    assert not short and all(times[k][:5] != [None] * 5 and times[k][5] is None for k in times)
    # (pool blocks, rows, blocks a row, distinct blocks) of each bucket's calls: 33-128 rows
    # timed at 40, 129-1024 at its first; each row's blocks its own where the pool holds them
    calls = sorted(set(seen))
    assert [c[:3] for c in calls] == [(1280, r, 32) for r in (1, 8, 32, 40, 129)]
    assert [c[3] for c in calls[:4]] == [32, 256, 1024, 1280]
    assert 1000 < calls[4][3] <= 1280  # 4128 blocks drawn from the 1280
    seen.clear()
    attention_tuning.time_shape(shape, "prefill", ["cpp-prefill"], deadline=float("inf"))
    # 2048 rows pass the bound, the bucket's first (1025) does not; 512 rows fit it
    assert sorted(set(seen)) == [(8, 1024), (32, 1024), (128, 1024), (512, 1024), (1025, 1025)]


def _decode_step(rows: int, decodes_only: bool):
    """Random caches and a step of ``rows`` decode rows over up to 40 positions each; where not
    ``decodes_only``, a 3-row prompt chunk (rows-as-decodes would take it; here it is the
    prefill path's) follows them."""
    gen = torch.Generator().manual_seed(rows)
    num_heads, block_size, num_kv_heads, head_dim, dtype = SHAPE
    key_cache, value_cache = (
        torch.randn(64, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
        for _ in range(2)
    )
    chunk = [] if decodes_only else [attention.PrefillSeq(rows, rows + 3, 20, torch.tensor([9, 3]))]
    total = rows + (0 if decodes_only else 3)
    metadata = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.long),
        decode_indices=torch.arange(rows),
        decode_block_tables=torch.randperm(60, generator=gen)[: rows * 3].view(rows, 3),
        decode_seq_lens=torch.randint(1, 40, (rows,), generator=gen),
        prefills=chunk,
        decodes_only=decodes_only,
    )
    query = torch.randn(total, num_heads, head_dim, generator=gen).to(dtype)
    return query, key_cache, value_cache, metadata


@pytest.mark.parametrize("decodes_only", [True, False])
def test_decode_rows_take_the_planned_path_by_their_number(monkeypatch, decodes_only):
    """A plan of the C++ kernel at one row and torch's path from two: a step's decode rows take
    the path of their count's bucket, each with the other's result within rounding; the fused
    qkv call and the whole-layer call step aside for the rows torch's path takes."""
    from llmrpc.kernels import layer

    calls = []
    real_torch = attention.decode_attention_torch

    def counted(*args, **kwargs):
        calls.append(args[0].shape[0])
        return real_torch(*args, **kwargs)

    monkeypatch.setattr(attention, "decode_attention_torch", counted)
    buckets = ((1, "cpp-decode"), (8, "torch-sdpa"), (None, "torch-sdpa"))
    attention.set_kernels("decode", SHAPE, buckets)
    num_heads = SHAPE[0]
    for rows in (1, 2, 5):
        query, key_cache, value_cache, metadata = _decode_step(rows, decodes_only)
        calls.clear()
        got = attention.paged_attention(query, key_cache, value_cache, metadata, 0.125)
        assert calls == ([] if rows == 1 else [rows])
        expected = attention.decode(
            query[:rows], key_cache, value_cache, metadata, 0.125,
            "torch-sdpa" if rows == 1 else "cpp-decode",
        )  # fmt: skip
        torch.testing.assert_close(got[:rows], expected, atol=2e-2, rtol=2e-2)
        assert attention.decode_kernel_planned(num_heads, key_cache, rows) == (rows == 1)
        # the fused calls: where the plan takes the kernel for the rows, and only there
        width = (num_heads + 2 * SHAPE[2]) * SHAPE[3]
        qkv = torch.zeros(rows, width, dtype=SHAPE[4])
        rotary = (torch.ones(rows, 1, SHAPE[3], dtype=SHAPE[4]),) * 2
        metadata.decodes_only = True
        spec = layer.LayerSpec([], [], SHAPE[4], None)
        fused = layer.fits(spec, qkv, rotary, (key_cache, value_cache), metadata, num_heads)
        assert fused == (rows == 1)
        if rows > 1:
            assert attention.decode_attention_qkv(
                qkv, rotary, key_cache, value_cache, metadata, num_heads, 0.125
            ) is None  # fmt: skip


def test_compiled_steps_take_the_rows_the_kernel_was_planned_for():
    assert attention.compiled_decode_rows() is None  # unplanned: any
    attention.set_kernels(
        "decode", SHAPE, ((1, "cpp-decode"), (8, "cpp-decode"), (None, "cpp-decode"))
    )
    assert attention.compiled_decode_rows() is None
    attention.set_kernels("prefill", SHAPE, ((1, "torch-sdpa"), (None, "torch-sdpa")))
    assert attention.compiled_decode_rows() is None  # prompt chunks do not run compiled
    attention.set_kernels(
        "decode", SHAPE, ((1, "cpp-decode"), (32, "cpp-decode"), (None, "torch-sdpa"))
    )
    assert attention.compiled_decode_rows() == 32
    other = (4, 16, 2, 64, torch.bfloat16)
    attention.set_kernels("decode", other, ((1, "torch-sdpa"), (None, "torch-sdpa")))
    assert attention.compiled_decode_rows() == 0  # the fewest of every shape's


def test_a_compiled_step_is_refused_where_the_kernel_was_planned_for_too_few_rows():
    """The compiled step holds the C++ kernel: it takes the rows the plan gives the kernel, and
    where those are fewer than its warm-up's, the engine runs eager and says why."""
    from llmrpc.engine.runner.compilation import max_compiled_rows, why_not_compiled

    model = torch.nn.Linear(2, 2)  # (no quantized layer: no limit of its own)
    attention.set_kernels("decode", SHAPE, ((8, "cpp-decode"), (None, "torch-sdpa")))
    assert max_compiled_rows(model) == 8 and why_not_compiled(model, "torch") is None
    attention.set_kernels("decode", SHAPE, ((1, "cpp-decode"), (None, "torch-sdpa")))
    assert max_compiled_rows(model) == 1
    reason = why_not_compiled(model, "torch")
    assert reason == (
        "decode attention was measured faster on torch's path than in the C++ kernel, which "
        "the compiled step holds, from 2 rows"
    )


def test_a_call_is_timed_repeats_times_or_for_min_seconds_and_less_when_far_behind(monkeypatch):
    calls = []
    run = functools.partial(calls.append, None)
    linear_tuning.call_time(run)
    assert len(calls) == linear_tuning.REPEATS + 1  # a warm-up and the timed runs
    calls.clear()
    assert linear_tuning.call_time(run, best_us=0.0) > 0
    assert len(calls) == 2  # a warm-up and one timed run
    calls.clear()
    linear_tuning.call_time(run, best_us=1e6)  # (a second: no call of this takes two)
    assert len(calls) == linear_tuning.REPEATS + 1
    calls.clear()
    linear_tuning.call_time(run, min_seconds=60.0)  # more runs, up to 64, for a short call
    assert len(calls) == 65
    calls.clear()
    # a call of 4 ms on the clock call_time reads (a slept one overran on a busy machine)
    clock = [0.0]
    monkeypatch.setattr(linear_tuning, "time", SimpleNamespace(perf_counter=lambda: clock[0]))

    def slow() -> None:  # 20 ms take 5 calls past the warm-up
        calls.append(None)
        clock[0] += 0.004

    assert linear_tuning.call_time(slow, min_seconds=0.0195) == pytest.approx(4000.0)
    assert len(calls) == 6
    calls.clear()
    linear_tuning.call_time(slow, min_seconds=0.0195, best_us=0.0)  # far behind: after 20 ms
    assert len(calls) == 6
