"""``--distributed-executor-backend ray``: ranks 1..N-1 as Ray actors, on any node of a cluster.

Rank 0 stays the engine process, which becomes the Ray driver: it joins the cluster that
``RAY_ADDRESS`` names (``ray start --head`` on one machine, ``ray start --address`` on the
others); it must be running. Each other rank is an actor taking one CPU of the cluster (on
CUDA also one GPU, the device it computes on; rank 0 computes on the engine's ``cuda:0``, which
Ray does not know of, so a GPU given to two ranks stops start-up); it loads the model from the
same path (which must exist on its node), keeps its shard and its part of the KV cache, and
runs the forward of each step that rank 0 sends it as an actor call (one caller's calls to a
single-threaded actor run in the order made). The collectives are gloo on the CPU and NCCL on
CUDA, as with ``mp``, over a TCP store that rank 0 serves at its node's address.

A dead actor fails the call in flight to it: each check keeps one ``ping`` in flight (behind
the steps) and raises once it fails; mid-step, gloo fails the collective the rank leaves, and
on CUDA a thread keeping pings of its own in flight aborts the NCCL group once one fails.
"""

from __future__ import annotations

import logging
import os
import pickle
import time

import ray
import torch

from llmrpc.engine.parallel.devices import (
    check_distinct_devices,
    host_step,
    min_across_ranks,
    ray_actor_device,
)
from llmrpc.engine.parallel.executor import (
    LOAD_TIMEOUT_S,
    START_TIMEOUT_S,
    DeathWatch,
    WorkerDied,
    close_group,
    free_port,
    join_group,
    rank_kv_config,
    rank_threads,
)
from llmrpc.engine.parallel.layers import Collectives, Rank, shard_llama
from llmrpc.engine.parallel.worker import Shard

logger = logging.getLogger(__name__)


@ray.remote(num_cpus=1)
class RankActor:
    def __init__(self, config, rank: int, threads: int, device_type: str = "cpu") -> None:
        torch.set_num_threads(threads)
        self.config, self.rank = config, Rank(rank, config.parallel.tensor_parallel_size)
        self.device = torch.device("cpu")
        if device_type == "cuda":  # the GPU Ray gave this actor
            self.device = ray_actor_device(ray.get_gpu_ids(), torch.cuda.device_count())
            torch.cuda.set_device(self.device)
        self.shard: Shard | None = None

    def pid(self) -> int:
        return os.getpid()

    def device_uuid(self) -> str:
        return str(torch.cuda.get_device_properties(self.device).uuid)

    def join(self, host: str, port: int) -> None:
        join_group(self.rank.rank, self.rank.size, port, host, self.device)

    def load(self, allocate_kv_cache: bool) -> None:
        self.shard = Shard(self.config, Collectives(self.rank), self.device)
        if allocate_kv_cache:
            self.shard.allocate_kv_cache()

    def size_kv_cache(self, profile_tokens: int) -> None:
        self._or_exit(self.shard.size_kv_cache, profile_tokens)

    def step(self, data: bytes) -> None:
        self._or_exit(self.shard.run_step, data)

    def _or_exit(self, work, argument) -> None:
        try:
            work(argument)
        except BaseException:  # noqa: BLE001 - the other ranks wait in a collective for this one
            logger.exception("tensor-parallel rank %d failed; it exits", self.rank.rank)
            os._exit(1)  # its sockets close, so gloo fails their collective at once

    def ping(self) -> None:
        pass


def ray_address() -> str:
    """The cluster to join. A local one started here would outlive the engine process, which
    ends without Python's exit handlers (Ray's agents stay), so one must be running."""
    address = os.environ.get("RAY_ADDRESS", "").strip()
    if not address:
        raise ValueError(
            "--distributed-executor-backend ray joins the Ray cluster that RAY_ADDRESS names "
            "(start one with `ray start --head`); RAY_ADDRESS is not set"
        )
    return address


class RayTensorParallel:
    """``executor.TensorParallel``'s interface, with Ray actors as ranks 1..N-1."""

    def __init__(
        self, config, size: int, device: torch.device, profile_tokens: int | None = None
    ) -> None:
        self.rank, self.device = Rank(0, size), device
        self.expert_parallel = config.parallel.enable_expert_parallel
        self.comm = Collectives(self.rank, sync_gather=device.type == "cuda")
        self.actors: list = []
        self.watch: DeathWatch | None = None
        self._profile_tokens = profile_tokens
        self._sized: list = []  # the actors' KV cache sizing calls (CUDA, profiled)
        try:
            self._start(config, size)
        except BaseException:
            self.close(now=True)
            raise

    def _start(self, config, size: int) -> None:
        if not ray.is_initialized():
            ray.init(address=ray_address(), configure_logging=False, log_to_driver=True)
        host = ray.util.get_node_ip_address()
        port = free_port()
        threads = rank_threads(size)
        torch.set_num_threads(threads)
        cuda = self.device.type == "cuda"
        options = {"num_gpus": 1} if cuda else {}
        self.actors = [
            RankActor.options(**options).remote(config, rank, threads, self.device.type)
            for rank in range(1, size)
        ]
        self.pids = self._get([actor.pid.remote() for actor in self.actors], START_TIMEOUT_S)
        if cuda:
            uuids = self._get([actor.device_uuid.remote() for actor in self.actors], 60)
            check_distinct_devices(
                [str(torch.cuda.get_device_properties(self.device).uuid)] + uuids
            )
        joined = [actor.join.remote(host, port) for actor in self.actors]
        join_group(0, size, port, host, self.device)
        self._get(joined, START_TIMEOUT_S)
        allocate = self._profile_tokens is None
        self._loaded = [actor.load.remote(allocate) for actor in self.actors]
        self._in_flight = [None] * len(self.actors)  # each actor's last call not yet seen done
        if cuda:
            self._watch_pings = [None] * len(self.actors)  # the watch thread's own
            self.watch = DeathWatch(self.comm, self._find_death)
        backend = "NCCL" if cuda else "gloo"
        logger.info("tensor parallel on Ray: %d ranks, %s at %s:%d", size, backend, host, port)

    def _get(self, refs, timeout: float):
        try:
            return ray.get(refs, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            wanted = "CPUs and GPUs" if self.device.type == "cuda" else "CPUs"
            raise WorkerDied(
                f"tensor-parallel ranks on Ray not ready after {timeout:.0f} s (does the "
                f"cluster have {len(self.actors)} free {wanted}?)"
            ) from None
        except ray.exceptions.RayError as error:
            raise WorkerDied(f"a tensor-parallel rank on Ray failed: {error}") from error

    def shard(self, model) -> None:
        shard_llama(model, self.comm, self.expert_parallel)
        self._get(self._loaded, LOAD_TIMEOUT_S)
        if self._profile_tokens is not None:  # the step rank 0 is about to profile
            profile = self._profile_tokens
            self._sized = [actor.size_kv_cache.remote(profile) for actor in self.actors]

    def agree_on_kv_blocks(self, num_blocks: int) -> int:
        """As ``TensorParallel.agree_on_kv_blocks``."""
        try:
            agreed = min_across_ranks(num_blocks, self.device)
        except Exception:
            self.comm.raise_if_failed()  # a rank that died: named
            raise
        self._get(self._sized, LOAD_TIMEOUT_S)
        return agreed

    def rank_hf_config(self, hf_config):
        return rank_kv_config(hf_config, self.rank.size)

    def _describe(self, index: int, error: Exception) -> str:
        return (
            f"tensor-parallel rank {index + 1} (Ray actor, pid {self.pids[index]}) died: "
            f"{type(error).__name__}"
        )

    def check(self) -> None:
        """Raise ``WorkerDied`` once a call to an actor has failed; keep a ping in flight."""
        for index, actor in enumerate(self.actors):
            ref = self._in_flight[index]
            if ref is not None:
                done, _ = ray.wait([ref], timeout=0)
                if not done:
                    continue
                try:
                    ray.get(ref)
                except ray.exceptions.RayError as error:
                    raise WorkerDied(self._describe(index, error)) from error
            self._in_flight[index] = actor.ping.remote()

    def _find_death(self, timeout: float) -> str | None:
        """The watch thread's check (CUDA): a ping of its own in flight to each actor (queued
        behind the steps), waited for up to ``timeout`` seconds; a failed one is a death."""
        for index, actor in enumerate(self.actors):
            if self._watch_pings[index] is None:
                self._watch_pings[index] = actor.ping.remote()
        done, _ = ray.wait(list(self._watch_pings), num_returns=1, timeout=timeout)
        for index, ref in enumerate(self._watch_pings):
            if ref in done:
                self._watch_pings[index] = None
                try:
                    ray.get(ref)
                except ray.exceptions.RayError as error:
                    return self._describe(index, error)
        if done:  # an idle actor answers at once: ask again a little later
            time.sleep(timeout)
        return None

    def broadcast_step(self, input_ids, positions, metadata, logits_indices) -> None:
        self.check()
        step = (input_ids, positions, metadata, logits_indices)
        if self.device.type == "cuda":
            step = host_step(step, self.device)
        payload = pickle.dumps(step, protocol=5)
        for actor in self.actors:
            actor.step.remote(payload)  # after the ping: its failure is seen by the next check

    def close(self, now: bool = False) -> None:
        """Kill the actors (at once either way: ``now`` is ``TensorParallel.close``'s)."""
        if self.watch is not None:
            self.watch.stop()
        for actor in self.actors:
            ray.kill(actor)
        close_group(self.device)
