"""Where each tensor-parallel rank computes, and how the ranks talk: pure choices (checked by
the CPU tests), the one collective that makes the ranks agree on their KV cache's size, and
the moves of a step's inputs between host and device.

On the CPU every rank computes on the CPU and the ranks' process group is gloo. On CUDA each
rank has a device of its own and the group is NCCL: with ``mp``, rank r runs on ``cuda:r`` of
the devices visible to the engine process (``CUDA_VISIBLE_DEVICES``), rank 0 being the engine
itself; with ``ray``, ranks 1..N-1 each run on the one GPU Ray gave its actor.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import torch
import torch.distributed as dist


def process_group_backend(device_type: str) -> str:
    """torch.distributed's backend for ranks computing on ``device_type``."""
    if device_type == "cpu":
        return "gloo"
    if device_type == "cuda":
        return "nccl"
    raise ValueError(
        f"--tensor-parallel-size runs its ranks on the CPU (gloo) or on CUDA devices (NCCL), "
        f"not on {device_type}"
    )


def rank_device(device_type: str, rank: int) -> torch.device:
    """Rank ``rank``'s device under ``mp``: the CPU, or ``cuda:rank`` of the visible devices."""
    if device_type == "cuda":
        return torch.device("cuda", rank)
    return torch.device(device_type)


def check_rank_devices(
    size: int, device: torch.device, local_ranks: int, num_visible: int, nccl: bool
) -> None:
    """Refuse, in one line, CUDA ranks this machine cannot place: ``local_ranks`` of the ``size``
    ranks run here (all under ``mp``, rank 0 alone under ``ray``) on ``cuda:0``.. of the
    ``num_visible`` devices, and rank 0 is the engine's own ``device``."""
    if device.type != "cuda":
        return
    flag = f"--tensor-parallel-size {size}"
    if not nccl:
        raise ValueError(f"{flag} on CUDA needs torch.distributed's NCCL, which this torch lacks")
    if num_visible < local_ranks:
        listed = os.environ.get("CUDA_VISIBLE_DEVICES")
        where = f" (CUDA_VISIBLE_DEVICES={listed})" if listed is not None else ""
        raise ValueError(
            f"{flag} on CUDA runs each rank on a device of its own: {local_ranks} needed on this "
            f"machine, {num_visible} visible{where}"
        )
    if device.index not in (None, 0):
        raise ValueError(f"{flag}: rank 0 runs on cuda:0, but the engine's device is {device}")


def ray_actor_device(gpu_ids: list, num_visible: int) -> torch.device:
    """The device of a Ray actor that asked for one GPU. Ray makes that GPU the only one the
    actor sees (``cuda:0``), unless ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES`` leaves the
    node's devices visible: then it is the one whose id Ray gave."""
    if len(gpu_ids) != 1:
        raise ValueError(f"a tensor-parallel rank on Ray holds {len(gpu_ids)} GPUs, not one")
    return torch.device("cuda", 0 if num_visible == 1 else int(gpu_ids[0]))


def check_distinct_devices(uuids: list[str]) -> None:
    """NCCL runs one rank per device; ``uuids[r]`` is rank r's device. Ray cannot know that
    rank 0, the engine process (not an actor), holds a GPU, and may give that one to an actor."""
    first_rank: dict[str, int] = {}
    for rank, uuid in enumerate(uuids):
        if uuid in first_rank:
            raise ValueError(
                f"--distributed-executor-backend ray gave tensor-parallel ranks "
                f"{first_rank[uuid]} and {rank} the same GPU ({uuid}); rank 0 runs in the engine "
                "process outside Ray, so start this machine's Ray node without the engine's "
                "GPU (CUDA_VISIBLE_DEVICES for `ray start`) or run the engine on a GPU Ray does "
                "not hold"
            )
        first_rank[uuid] = rank


def min_across_ranks(value: int, device: torch.device) -> int:
    """The smallest of every rank's ``value``: each rank calls this with its own (a collective
    over the process group, whose tensors live on ``device``)."""
    tensor = torch.tensor([value], dtype=torch.long, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return int(tensor.item())


def map_step(step: tuple, move: Callable[[str, torch.Tensor], torch.Tensor]) -> tuple:
    """``step`` (input_ids, positions, metadata, logits_indices) with each tensor ``t``
    replaced by ``move(name, t)``; ``name`` says which input ``t`` is."""
    input_ids, positions, metadata, logits_indices = step
    changes = {
        field.name: move(field.name, value)
        for field in dataclasses.fields(metadata)
        if isinstance(value := getattr(metadata, field.name), torch.Tensor)
    }
    changes["prefills"] = [
        dataclasses.replace(seq, block_ids=move(f"prefill_block_ids{i}", seq.block_ids))
        for i, seq in enumerate(metadata.prefills)
    ]
    return (
        move("input_ids", input_ids),
        move("positions", positions),
        dataclasses.replace(metadata, **changes),
        move("logits_indices", logits_indices),
    )


def host_step(step: tuple, device: torch.device) -> tuple:
    """A CUDA step's inputs copied to the host, to be pickled: all copies started, then one
    wait for them."""
    step = map_step(step, lambda _, tensor: tensor.to("cpu", non_blocking=True))
    torch.cuda.current_stream(device).synchronize()
    return step
