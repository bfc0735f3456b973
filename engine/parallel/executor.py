"""Rank 0's side of tensor parallelism (``--distributed-executor-backend mp``).

Rank 0 is the engine core itself: scheduler, sampler and detokenizer stay in the engine
process, which also holds the first shard of the model. Ranks 1..N-1 are worker processes
(``worker.py``) that hold the other shards and their part of the KV cache and run only the
forward pass. Each step rank 0 sends the step's inputs (ids, positions, attention metadata,
the rows whose logits are wanted: a few small tensors, pickled; on CUDA copied to the host
first, with one wait for the copies) down a pipe to each worker; then every rank runs the
forward, whose collectives (gloo on the CPU, NCCL on CUDA: ``devices.py``) join them, and rank 0
gets the whole logits. A pipe, not a collective, carries the inputs: an idle worker waits on it
without a timeout, and its end of file tells the worker the engine is gone.

A worker that dies is seen by its process sentinel before each step and at each stats
refresh (every second while idle), or by the collective it leaves hanging: gloo fails it when
the peer's socket closes; NCCL would wait for the peer forever, so on CUDA a thread
(``DeathWatch``) waits on the sentinels and aborts the process group, which releases the
collective (``layers.Collectives``). Either way the engine fails as on a failed forward pass.
A start-up that fails after the workers started ends them at once.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import multiprocessing
import os
import pickle
import socket
import threading
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import wait

import torch
import torch.distributed as dist

from llmrpc.engine.parallel.devices import (
    check_rank_devices,
    host_step,
    min_across_ranks,
    process_group_backend,
)
from llmrpc.engine.parallel.layers import (
    Collectives,
    Rank,
    WorkerDied,
    check_shardable,
    kv_heads_per_rank,
    shard_llama,
)

logger = logging.getLogger(__name__)

# How long a collective waits for a peer that is alive but late (gloo fails at once on a
# peer whose socket closed): a long prompt chunk on a loaded machine can take minutes.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)
# How long a worker has to start and join, and then to load its shard.
START_TIMEOUT_S = 120.0
LOAD_TIMEOUT_S = 1800.0
# How often the CUDA death watch looks again (it wakes at once on an mp worker's exit).
WATCH_PERIOD_S = 0.5


def rank_threads(size: int) -> int:
    """Each rank's torch threads: ``OMP_NUM_THREADS`` if set, else its share of the cores."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    if value:
        return max(1, int(value.split(",")[0]))
    return max(1, len(os.sched_getaffinity(0)) // size)


def join_group(
    rank: int, size: int, port: int, host: str = "127.0.0.1", device: torch.device | None = None
) -> None:
    """Join the ranks' process group over a TCP store that rank 0 serves at ``host:port``
    (loopback for local ranks): gloo for ranks on the CPU, NCCL bound to ``device`` on CUDA."""
    device = device or torch.device("cpu")
    store = dist.TCPStore(host, port, size, rank == 0, timeout=COLLECTIVE_TIMEOUT)
    bound = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(
        process_group_backend(device.type),
        store=store,
        rank=rank,
        world_size=size,
        timeout=COLLECTIVE_TIMEOUT,
        **bound,
    )


def close_group(device: torch.device) -> None:
    """Leave the process group. NCCL's is aborted rather than destroyed: a destroy waits for
    collectives in flight, which a dead or stuck rank never finishes."""
    if not dist.is_initialized():  # never joined, or aborted already
        return
    if device.type == "cuda":
        abort_group()
    else:
        dist.destroy_process_group()


def abort_group() -> None:
    """Abort the NCCL process group: collectives waiting for a dead rank return (and fail)."""
    from torch.distributed.distributed_c10d import _abort_process_group

    if not dist.is_initialized():  # never joined, or aborted already
        return
    try:
        _abort_process_group()
    except Exception:  # noqa: BLE001 - the engine is failing already; say so and go on
        logger.exception("aborting the NCCL process group failed")


class DeathWatch:
    """A thread that waits for another rank's death (``find_death(timeout)`` answers its
    description, or None after ``timeout`` seconds), then records it in ``comm`` and aborts the
    NCCL process group, so a collective waiting for that rank fails instead of waiting forever."""

    def __init__(self, comm: Collectives, find_death: Callable[[float], str | None]) -> None:
        self.comm, self._find_death = comm, find_death
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="llmrpc-tp-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            failure = self._find_death(WATCH_PERIOD_S)
            if failure is not None and not self._stop.is_set():
                logger.error("%s; aborting the NCCL process group", failure)
                self.comm.failure = failure  # before the abort releases the engine's thread
                abort_group()
                return

    def stop(self) -> None:
        """Stop watching (before the ranks are told to exit)."""
        self._stop.set()
        self._thread.join(4 * WATCH_PERIOD_S)


def rank_kv_config(hf_config, size: int):
    """The model's configuration as one rank sees it: its KV heads (sizes its KV cache)."""
    config = copy.copy(hf_config)
    config.head_dim = getattr(hf_config, "head_dim", None) or (
        hf_config.hidden_size // hf_config.num_attention_heads
    )
    kv_heads = getattr(hf_config, "num_key_value_heads", hf_config.num_attention_heads)
    config.num_key_value_heads = kv_heads_per_rank(kv_heads, size)
    return config


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclasses.dataclass
class _Worker:
    rank: int
    process: multiprocessing.Process
    conn: object  # multiprocessing.connection.Connection

    def describe_exit(self) -> str:
        return (
            f"tensor-parallel rank {self.rank} (pid {self.process.pid}) died, "
            f"exit code {self.process.exitcode}"
        )

    def describe_death(self) -> str:
        """``describe_exit``, with the error the worker sent before it exited, if any."""
        cause = ""
        try:
            if self.conn.poll():  # the worker sends its error before it exits
                message = self.conn.recv()
                if isinstance(message, tuple) and message[0] == "error":
                    cause = f": {message[1]}"
        except (EOFError, OSError):
            pass
        return f"{self.describe_exit()}{cause}"


def find_exited(workers: list[_Worker], timeout: float) -> str | None:
    """A worker that has exited (waiting up to ``timeout`` seconds for one), described."""
    ended = wait([worker.process.sentinel for worker in workers], timeout)
    for worker in workers:
        if worker.process.sentinel in ended:
            # the sentinel fires as the process closes its files, before it can be reaped
            worker.process.join(5)
            return worker.describe_exit()
    return None


class TensorParallel:
    """Started by the engine core before it loads the model; see the module's docstring.
    ``profile_tokens``: the tokens of the step each rank profiles to size its KV cache on CUDA
    (``--gpu-memory-utilization``), or None where the count is known (the CPU's
    ``--kv-cache-memory``, ``--num-gpu-blocks-override``)."""

    def __init__(
        self, config, size: int, device: torch.device, profile_tokens: int | None = None
    ) -> None:
        self.rank, self.device = Rank(0, size), device
        self.expert_parallel = config.parallel.enable_expert_parallel
        self.comm = Collectives(self.rank, sync_gather=device.type == "cuda")
        self.workers: list[_Worker] = []
        self.watch: DeathWatch | None = None
        try:
            self._start(config, size, profile_tokens)
        except BaseException:
            self.close(now=True)
            raise

    def _start(self, config, size: int, profile_tokens: int | None) -> None:
        port = free_port()
        context = multiprocessing.get_context("spawn")  # never fork a process running torch
        from llmrpc.engine.parallel import worker

        for rank in range(1, size):
            parent, child = context.Pipe()
            level = logging.getLogger().getEffectiveLevel()
            process = context.Process(
                target=worker.main,
                args=(config, rank, port, child, level, self.device.type, profile_tokens),
                name=f"llmrpc-tp-rank{rank}",
                daemon=True,
            )
            process.start()
            child.close()
            self.workers.append(_Worker(rank, process, parent))
        threads = rank_threads(size)
        torch.set_num_threads(threads)
        logger.info(
            "tensor parallel: %d ranks, %d CPU thread(s) each, %s on port %d",
            size,
            threads,
            process_group_backend(self.device.type),
            port,
        )
        self._expect("started", START_TIMEOUT_S)
        join_group(0, size, port, device=self.device)
        if self.device.type == "cuda":
            self.watch = DeathWatch(self.comm, self._find_death)

    def _expect(self, what: str, timeout: float) -> None:
        for worker in self.workers:
            ready = wait([worker.conn, worker.process.sentinel], timeout)
            if not ready:
                raise WorkerDied(
                    f"tensor-parallel rank {worker.rank} not {what} after {timeout:.0f} s"
                )
            try:
                message = worker.conn.recv() if worker.conn in ready else None
            except EOFError:  # it exited without a word
                message = None
            if message is None:
                worker.process.join(5)  # its exit code, once it can be reaped
                raise WorkerDied(worker.describe_death())
            if message != what:
                raise WorkerDied(f"tensor-parallel rank {worker.rank} failed: {message[1]}")

    def _find_death(self, timeout: float) -> str | None:
        return find_exited(self.workers, timeout)

    def shard(self, model) -> None:
        """Keep rank 0's shard of the loaded model, then wait for the workers to hold theirs."""
        shard_llama(model, self.comm, self.expert_parallel)
        self._expect("ready", LOAD_TIMEOUT_S)

    def agree_on_kv_blocks(self, num_blocks: int) -> int:
        """The KV blocks of every rank: the fewest any rank's device has room for (each rank
        measured its own in the same profiled step), so the scheduler's block ids hold on all."""
        try:
            agreed = min_across_ranks(num_blocks, self.device)
        except Exception:
            self.check()  # a worker that died: named, with its error
            raise
        if agreed < num_blocks:
            logger.info(
                "KV cache: %d blocks, the fewest of any rank (rank 0: %d)", agreed, num_blocks
            )
        return agreed

    def rank_hf_config(self, hf_config):
        return rank_kv_config(hf_config, self.rank.size)

    def check(self) -> None:
        """Raise ``WorkerDied`` naming the first worker that has exited, and why."""
        for worker in self.workers:
            if not worker.process.is_alive():
                raise WorkerDied(worker.describe_death())

    def broadcast_step(self, input_ids, positions, metadata, logits_indices) -> None:
        """Send one step's inputs to every worker (before rank 0's own forward)."""
        self.check()
        step = (input_ids, positions, metadata, logits_indices)
        if self.device.type == "cuda":
            step = host_step(step, self.device)
        # plain pickle, by value: a Connection's own pickler would move tensors to shared memory
        payload = pickle.dumps(step, protocol=5)
        for worker in self.workers:
            try:
                worker.conn.send_bytes(payload)
            except OSError as error:
                raise WorkerDied(worker.describe_death()) from error

    def close(self, now: bool = False) -> None:
        """End the workers: tell them to exit and wait a little for them (with ``now``, as on a
        failed start-up, not at all: a worker may be loading, or waiting in a collective for
        rank 0); any still running then are terminated."""
        if self.watch is not None:
            self.watch.stop()  # these exits are no failure
        if not now:
            for worker in self.workers:
                with contextlib.suppress(OSError):  # already gone
                    worker.conn.send_bytes(pickle.dumps(None))
            for worker in self.workers:
                worker.process.join(5)
        for worker in self.workers:
            end_process(worker.process)
        close_group(self.device)


def end_process(process: multiprocessing.Process) -> None:
    """Terminate ``process`` if it still runs, and kill it if that does not end it soon."""
    if process.is_alive():
        process.terminate()
        process.join(2)
    if process.is_alive():
        process.kill()
        process.join(2)


def start_tensor_parallel(
    config, hf_config, device: torch.device, runner: str, profile_tokens: int | None = None
):
    """The ``TensorParallel`` of ``config``, or None for one rank; refuses what it cannot run.
    ``profile_tokens``: as ``TensorParallel`` takes it."""
    parallel = config.parallel
    if not parallel.enabled:
        return None
    size = parallel.tensor_parallel_size
    check_engine_options(config, device, runner)
    check_model(hf_config, config.model.model_impl, size, parallel.enable_expert_parallel)
    ray = parallel.distributed_executor_backend == "ray"
    cuda = device.type == "cuda"
    visible = torch.cuda.device_count() if cuda else 0
    nccl = cuda and dist.is_nccl_available()
    check_rank_devices(size, device, 1 if ray else size, visible, nccl)
    if ray:
        from llmrpc.engine.parallel.ray_executor import RayTensorParallel

        return RayTensorParallel(config, size, device, profile_tokens)
    return TensorParallel(config, size, device, profile_tokens)


def check_engine_options(config, device: torch.device, runner: str) -> None:
    """What this build does not combine with tensor parallelism, refused in one line each."""
    size = config.parallel.tensor_parallel_size
    flag = f"--tensor-parallel-size {size}"
    model = config.model
    refusals = (
        (
            device.type not in ("cpu", "cuda"),
            f"runs on the CPU (gloo) or on CUDA devices (NCCL), not on {device.type}",
        ),
        (
            model.model_impl == "transformers",
            "shards the native models only, not --model-impl transformers",
        ),
        (model.quantization is not None, f"is refused with --quantization {model.quantization}"),
        (config.compilation.level > 0, "runs eager: use -O0 (the default) or --enforce-eager"),
        (model.enable_sleep_mode, "is refused with --enable-sleep-mode"),
        (runner == "pooling", "is refused for a pooling model (here --runner resolves to pooling)"),
    )
    for refused, why in refusals:
        if refused:
            raise ValueError(f"{flag} {why}")


def check_model(hf_config, model_impl: str, size: int, expert_parallel: bool = False) -> None:
    """A native Llama-family model whose heads and features split over ``size`` ranks."""
    from llmrpc.engine.models import LlamaForCausalLM, model_class

    if not issubclass(model_class(hf_config, model_impl), LlamaForCausalLM):
        architectures = getattr(hf_config, "architectures", None) or ["(none)"]
        raise ValueError(
            f"--tensor-parallel-size {size} shards the native Llama-family models only, not "
            f"{architectures[0]}"
        )
    check_shardable(hf_config, size, expert_parallel)
