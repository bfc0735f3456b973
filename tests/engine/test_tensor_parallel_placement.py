"""Where tensor-parallel ranks run and how they talk, checked on the CPU: the backend and device
of each rank, the refusals of CUDA placements this machine cannot hold, the KV-block minimum
over a real two-process group, the moves of a step's inputs, and the death watch that releases
NCCL collectives waiting for a dead rank."""

from __future__ import annotations

import multiprocessing
import time

import pytest
import torch

from llmrpc.engine.parallel.devices import (
    check_distinct_devices,
    check_rank_devices,
    map_step,
    min_across_ranks,
    process_group_backend,
    rank_device,
    ray_actor_device,
)
from llmrpc.engine.parallel.executor import (
    DeathWatch,
    _Worker,
    find_exited,
    free_port,
    join_group,
)
from llmrpc.engine.parallel.layers import Collectives, Rank, WorkerDied
from llmrpc.kernels.attention import AttentionMetadata, PrefillSeq

CUDA0, CUDA1 = torch.device("cuda", 0), torch.device("cuda", 1)


def test_each_rank_computes_on_its_own_device_over_the_devices_backend():
    assert process_group_backend("cpu") == "gloo"
    assert process_group_backend("cuda") == "nccl"
    with pytest.raises(ValueError, match="not on mps"):
        process_group_backend("mps")
    assert [rank_device("cuda", rank) for rank in range(3)] == [
        CUDA0,
        CUDA1,
        torch.device("cuda", 2),
    ]
    assert rank_device("cpu", 2) == torch.device("cpu")


def test_cuda_placements_this_machine_cannot_hold_are_refused_in_one_line(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    check_rank_devices(4, torch.device("cpu"), 4, 0, False)  # the CPU: nothing to place
    check_rank_devices(2, CUDA0, 2, 2, True)
    check_rank_devices(4, CUDA0, 1, 1, True)  # ray: rank 0 alone here, the rest on Ray's GPUs
    with pytest.raises(ValueError, match=r"^--tensor-parallel-size 4 on CUDA runs each rank on a "):
        check_rank_devices(4, CUDA0, 4, 3, True)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,5")
    with pytest.raises(ValueError, match=r"4 needed on this machine, 2 visible \(CUDA_VISIBLE_DEV"):
        check_rank_devices(4, CUDA0, 4, 2, True)
    with pytest.raises(ValueError, match="needs torch.distributed's NCCL"):
        check_rank_devices(2, CUDA0, 2, 2, False)
    with pytest.raises(
        ValueError, match="rank 0 runs on cuda:0, but the engine's device is cuda:1"
    ):
        check_rank_devices(2, CUDA1, 2, 2, True)


def test_a_ray_rank_uses_the_gpu_ray_gave_it_and_two_ranks_never_share_one():
    assert ray_actor_device(["3"], 1) == CUDA0  # Ray left it only that device to see
    assert ray_actor_device([3], 4) == torch.device("cuda", 3)  # Ray left the node's visible
    with pytest.raises(ValueError, match="holds 2 GPUs, not one"):
        ray_actor_device([0, 1], 2)
    check_distinct_devices(["GPU-a", "GPU-b", "GPU-c"])
    with pytest.raises(
        ValueError, match=r"gave tensor-parallel ranks 0 and 2 the same GPU \(GPU-a"
    ):
        check_distinct_devices(["GPU-a", "GPU-b", "GPU-a"])


def _rank_minimum(rank: int, port: int, value: int, results) -> None:
    join_group(rank, 2, port)
    results.put((rank, min_across_ranks(value, torch.device("cpu"))))


def test_every_rank_gets_the_fewest_kv_blocks_of_any_rank():
    """Two processes in a gloo group, as the ranks run it: each offers its own count."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = free_port()
    ranks = [
        context.Process(target=_rank_minimum, args=(rank, port, value, results))
        for rank, value in ((0, 1200), (1, 917))
    ]
    for process in ranks:
        process.start()
    try:
        assert sorted(results.get(timeout=120) for _ in ranks) == [(0, 917), (1, 917)]
    finally:
        for process in ranks:
            process.join(10)
            if process.is_alive():
                process.kill()


def test_a_steps_inputs_are_moved_tensor_by_tensor_and_named():
    metadata = AttentionMetadata(
        slot_mapping=torch.arange(5),
        decode_indices=torch.tensor([4]),
        decode_block_tables=torch.tensor([[0, 2]]),
        decode_seq_lens=torch.tensor([20]),
        prefills=[PrefillSeq(0, 4, 4, torch.tensor([1]))],
        backend="torch",
    )
    step = (torch.tensor([5, 6, 7, 8, 9]), torch.arange(5), metadata, torch.tensor([3, 4]))
    names = []

    def move(name, tensor):
        names.append(name)
        return tensor + 100

    input_ids, positions, moved, logits_indices = map_step(step, move)
    assert sorted(names) == sorted(
        [
            "input_ids",
            "positions",
            "logits_indices",
            "slot_mapping",
            "decode_indices",
            "decode_block_tables",
            "decode_seq_lens",
            "prefill_block_ids0",
        ]
    )
    assert input_ids.tolist() == [105, 106, 107, 108, 109]
    assert logits_indices.tolist() == [103, 104]
    assert moved.decode_block_tables.tolist() == [[100, 102]]
    assert moved.prefills[0].block_ids.tolist() == [101]
    assert (moved.prefills[0].query_end, moved.backend) == (4, "torch")
    assert moved.prefill_indices is None  # absent inputs stay absent
    assert metadata.slot_mapping.tolist() == [0, 1, 2, 3, 4]  # the step itself is unchanged


def test_a_collective_after_a_rank_died_raises_worker_died_naming_it():
    comm = Collectives(Rank(0, 2))
    tensor = torch.ones(3)
    with pytest.raises(ValueError, match="process group"):  # no group: torch's own error
        comm.all_reduce(tensor)
    comm.failure = "tensor-parallel rank 1 (pid 4242) died, exit code -9"
    with pytest.raises(WorkerDied, match=r"rank 1 \(pid 4242\) died, exit code -9"):
        comm.all_reduce(tensor)
    with pytest.raises(WorkerDied, match="rank 1"):
        comm.gather(tensor)


def _exit_after(seconds: float) -> None:
    time.sleep(seconds)


def test_the_death_watch_records_a_rank_that_exits_and_stops_quietly_when_told():
    """The watch of ``mp`` ranks (their process sentinels) over a process that exits."""
    context = multiprocessing.get_context("spawn")
    process = context.Process(target=_exit_after, args=(0.5,))
    process.start()
    workers = [_Worker(1, process, None)]
    comm = Collectives(Rank(0, 2), sync_gather=True)
    DeathWatch(comm, lambda timeout: find_exited(workers, timeout))
    deadline = time.monotonic() + 30
    while comm.failure is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert comm.failure == f"tensor-parallel rank 1 (pid {process.pid}) died, exit code 0"
    with pytest.raises(WorkerDied, match="exit code 0"):
        comm.all_reduce(torch.ones(1))

    quiet = Collectives(Rank(0, 2))
    watch = DeathWatch(quiet, lambda timeout: time.sleep(timeout) or "a death")
    watch.stop()  # while it waits: what it finds after is no failure
    assert quiet.failure is None
