"""A prompt chunk's attention path, chosen by timing here (kernel_ops/attention_tuning.py)."""

from __future__ import annotations

import pytest
import torch

from llmrpc.kernels import attention, attention_tuning, cpu_ops


@pytest.fixture(scope="module", autouse=True)
def kernels():
    assert cpu_ops.load(), "the C++ kernels did not build on this machine (see the log)"


def test_each_bucket_takes_its_fastest_path_and_an_untimed_one_the_last_choice():
    times = {
        "cpp-prefill": [None, 5.0, 9.0, 30.0, None, None],
        "torch-sdpa": [None, 4.0, 12.0, 90.0, None, None],
    }
    choice = attention_tuning.choose("shape", 30, times)
    assert choice.kernels == (
        "torch-sdpa", "torch-sdpa", "cpp-prefill", "cpp-prefill", "cpp-prefill", "cpp-prefill",
    )  # fmt: skip
    assert "2-8 rows torch-sdpa 4 us" in choice.describe()
    assert "129-1024 rows cpp-prefill (untimed)" in choice.describe()


def test_a_shape_the_kernel_cannot_take_has_torchs_path_alone():
    fits = attention_tuning.Shape(8, 16, 2, 64, torch.bfloat16)
    assert attention_tuning.candidates(fits) == ["cpp-prefill", "torch-sdpa"]
    assert attention_tuning.candidates(attention_tuning.Shape(8, 16, 2, 40, torch.bfloat16)) == [
        "torch-sdpa"
    ]  # a head size the kernel refuses


def test_the_plan_times_both_paths_and_sets_what_chunks_take(tmp_path, caplog):
    caches = [(torch.zeros(4, 16, 2, 64).bfloat16(),) * 2 for _ in range(3)]
    try:
        with caplog.at_level("INFO", logger="llmrpc.kernels.attention_tuning"):
            plan = attention_tuning.plan_prefill_attention(8, caches, tmp_path)
        (choice,) = plan.values()
        assert choice.num_layers == 3 and choice.op.startswith("prefill attention 8/2x64 heads")
        for index in range(1, 6):  # every bucket from two rows timed, the faster path chosen
            timed = {k: t[index] for k, t in choice.times_us.items()}
            assert None not in timed.values() and choice.kernels[index] == min(timed, key=timed.get)
        assert "attention kernels: prefill attention 8/2x64" in caplog.text
        query, key_cache = torch.zeros(300, 8, 64).bfloat16(), caches[0][0]
        for rows, index in ((2, 1), (300, 4)):
            seq = attention.PrefillSeq(0, rows, 1000, torch.arange(63))
            assert attention._planned_prefill(query, key_cache, seq) == choice.kernels[index]
        # a second start reads the measurement back
        caplog.clear()
        with caplog.at_level("INFO", logger="llmrpc.kernels.linear_tuning"):
            again = attention_tuning.plan_prefill_attention(8, caches, tmp_path)
        assert again == plan and "timed prefill attention" not in caplog.text
    finally:
        attention._prefill_kernels.clear()


def test_the_timing_stops_at_its_deadline():
    shape = attention_tuning.Shape(8, 16, 2, 64, torch.bfloat16)
    ticks = iter(range(100))
    times, short = attention_tuning.time_shape(
        shape, ["cpp-prefill", "torch-sdpa"], deadline=0.5, clock=lambda: next(ticks)
    )
    assert short  # the clock passed the deadline after the first bucket timed (2-8 rows)
    for path in ("cpp-prefill", "torch-sdpa"):
        assert times[path][0] is None and times[path][2:] == [None] * 4
        assert times[path][1] > 0
