"""Rank 0's side of tensor parallelism (``--distributed-executor-backend mp``).

Rank 0 is the engine core itself: scheduler, sampler and detokenizer stay in the engine
process, which also holds the first shard of the model. Ranks 1..N-1 are worker processes
(``worker.py``) that hold the other shards and their part of the KV cache and run only the
forward pass. Each step rank 0 sends the step's inputs (ids, positions, attention metadata,
the rows whose logits are wanted: a few small tensors, pickled) down a pipe to each worker;
then every rank runs the forward, whose collectives (gloo on the CPU) join them, and rank 0
gets the whole logits. A pipe, not a collective, carries the inputs: an idle worker waits on
it without a timeout, and its end of file tells the worker the engine is gone.

A worker that dies is seen by its process sentinel before each step and at each stats
refresh (every second while idle), or by the collective it leaves hanging, which gloo fails
when the peer's socket closes; either way the engine fails as on a failed forward pass.
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
from datetime import timedelta
from multiprocessing.connection import wait

import torch
import torch.distributed as dist

from llmrpc.engine.parallel.layers import Rank, check_shardable, kv_heads_per_rank, shard_llama

logger = logging.getLogger(__name__)

# How long a collective waits for a peer that is alive but late (gloo fails at once on a
# peer whose socket closed): a long prompt chunk on a loaded machine can take minutes.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)
# How long a worker has to start and join, and then to load its shard.
START_TIMEOUT_S = 120.0
LOAD_TIMEOUT_S = 1800.0


class WorkerDied(RuntimeError):
    pass


def rank_threads(size: int) -> int:
    """Each rank's torch threads: ``OMP_NUM_THREADS`` if set, else its share of the cores."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    if value:
        return max(1, int(value.split(",")[0]))
    return max(1, len(os.sched_getaffinity(0)) // size)


def join_group(rank: int, size: int, port: int, host: str = "127.0.0.1") -> None:
    """Join the ranks' process group over a TCP store that rank 0 serves at ``host:port``
    (loopback for local ranks)."""
    store = dist.TCPStore(host, port, size, rank == 0, timeout=COLLECTIVE_TIMEOUT)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT
    )


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

    def describe_death(self) -> str:
        cause = f"exit code {self.process.exitcode}"
        try:
            if self.conn.poll():  # the worker sends its error before it exits
                message = self.conn.recv()
                if isinstance(message, tuple) and message[0] == "error":
                    cause = f"{cause}: {message[1]}"
        except (EOFError, OSError):
            pass
        return f"tensor-parallel rank {self.rank} (pid {self.process.pid}) died, {cause}"


class TensorParallel:
    """Started by the engine core before it loads the model; see the module's docstring."""

    def __init__(self, config, size: int) -> None:
        self.rank = Rank(0, size)
        port = free_port()
        context = multiprocessing.get_context("spawn")  # never fork a process running torch
        from llmrpc.engine.parallel import worker

        self.workers: list[_Worker] = []
        for rank in range(1, size):
            parent, child = context.Pipe()
            level = logging.getLogger().getEffectiveLevel()
            process = context.Process(
                target=worker.main,
                args=(config, rank, port, child, level),
                name=f"llmrpc-tp-rank{rank}",
                daemon=True,
            )
            process.start()
            child.close()
            self.workers.append(_Worker(rank, process, parent))
        threads = rank_threads(size)
        torch.set_num_threads(threads)
        logger.info(
            "tensor parallel: %d ranks, %d CPU thread(s) each, gloo on port %d", size, threads, port
        )
        self._expect("started", START_TIMEOUT_S)
        join_group(0, size, port)

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
                raise WorkerDied(worker.describe_death())
            if message != what:
                raise WorkerDied(f"tensor-parallel rank {worker.rank} failed: {message[1]}")

    def shard(self, model) -> None:
        """Keep rank 0's shard of the loaded model, then wait for the workers to hold theirs."""
        shard_llama(model, self.rank)
        self._expect("ready", LOAD_TIMEOUT_S)

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
        # plain pickle, by value: a Connection's own pickler would move tensors to shared memory
        payload = pickle.dumps((input_ids, positions, metadata, logits_indices), protocol=5)
        for worker in self.workers:
            try:
                worker.conn.send_bytes(payload)
            except OSError as error:
                raise WorkerDied(worker.describe_death()) from error

    def close(self) -> None:
        """Tell the workers to exit and wait a little for them."""
        for worker in self.workers:
            with contextlib.suppress(OSError):  # already gone
                worker.conn.send_bytes(pickle.dumps(None))
        for worker in self.workers:
            worker.process.join(5)
        if dist.is_initialized():
            dist.destroy_process_group()


def start_tensor_parallel(config, hf_config, device: torch.device, runner: str):
    """The ``TensorParallel`` of ``config``, or None for one rank; refuses what it cannot run."""
    parallel = config.parallel
    if not parallel.enabled:
        return None
    check_engine_options(config, device, runner)
    check_model(hf_config, config.model.model_impl, parallel.tensor_parallel_size)
    if parallel.distributed_executor_backend == "ray":
        from llmrpc.engine.parallel.ray_executor import RayTensorParallel

        return RayTensorParallel(config, parallel.tensor_parallel_size)
    return TensorParallel(config, parallel.tensor_parallel_size)


def check_engine_options(config, device: torch.device, runner: str) -> None:
    """What this build does not combine with tensor parallelism, refused in one line each."""
    size = config.parallel.tensor_parallel_size
    flag = f"--tensor-parallel-size {size}"
    model = config.model
    refusals = (
        (device.type != "cpu", f"runs on the CPU (gloo) only in this build, not on {device.type}"),
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


def check_model(hf_config, model_impl: str, size: int) -> None:
    """A native Llama-family model whose heads and features split over ``size`` ranks."""
    from llmrpc.engine.models import LlamaForCausalLM, model_class

    if not issubclass(model_class(hf_config, model_impl), LlamaForCausalLM):
        architectures = getattr(hf_config, "architectures", None) or ["(none)"]
        raise ValueError(
            f"--tensor-parallel-size {size} shards the native Llama-family models only, not "
            f"{architectures[0]}"
        )
    check_shardable(hf_config, size)
