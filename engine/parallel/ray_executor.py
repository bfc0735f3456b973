"""``--distributed-executor-backend ray``: ranks 1..N-1 as Ray actors, on any node of a cluster.

Rank 0 stays the engine process, which becomes the Ray driver: it joins the cluster that
``RAY_ADDRESS`` names (``ray start --head`` on one machine, ``ray start --address`` on the
others); it must be running. Each other rank is an actor taking one CPU of the cluster; it
loads the model from the same path (which must exist on its node), keeps its shard and its part
of the KV cache, and runs the forward of each step that rank 0 sends it as an actor call (one
caller's calls to a single-threaded actor run in the order made). The collectives are gloo, as
with ``mp``, over a TCP store that rank 0 serves at its node's address.

A dead actor fails the call in flight to it: each check keeps one ``ping`` in flight (behind
the steps) and raises once it fails; mid-step, gloo fails the collective the rank leaves.
"""

from __future__ import annotations

import logging
import os
import pickle

import ray
import torch

from llmrpc.engine.parallel.executor import (
    LOAD_TIMEOUT_S,
    START_TIMEOUT_S,
    WorkerDied,
    free_port,
    join_group,
    rank_kv_config,
    rank_threads,
)
from llmrpc.engine.parallel.layers import Rank, shard_llama
from llmrpc.engine.parallel.worker import load_shard, run_step

logger = logging.getLogger(__name__)


@ray.remote(num_cpus=1)
class RankActor:
    def __init__(self, config, rank: int, threads: int) -> None:
        torch.set_num_threads(threads)
        self.config, self.rank = config, Rank(rank, config.parallel.tensor_parallel_size)
        self.model = self.kv_caches = None

    def pid(self) -> int:
        return os.getpid()

    def join(self, host: str, port: int) -> None:
        join_group(self.rank.rank, self.rank.size, port, host)

    def load(self) -> None:
        self.model, self.kv_caches = load_shard(self.config, self.rank)

    def step(self, data: bytes) -> None:
        try:
            run_step(self.model, self.kv_caches, data)
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

    def __init__(self, config, size: int) -> None:
        self.rank = Rank(0, size)
        if not ray.is_initialized():
            ray.init(address=ray_address(), configure_logging=False, log_to_driver=True)
        host = ray.util.get_node_ip_address()
        port = free_port()
        threads = rank_threads(size)
        torch.set_num_threads(threads)
        self.actors = [RankActor.remote(config, rank, threads) for rank in range(1, size)]
        self.pids = self._get([actor.pid.remote() for actor in self.actors], START_TIMEOUT_S)
        joined = [actor.join.remote(host, port) for actor in self.actors]
        join_group(0, size, port, host)
        self._get(joined, START_TIMEOUT_S)
        self._loaded = [actor.load.remote() for actor in self.actors]
        self._in_flight = [None] * len(self.actors)  # each actor's last call not yet seen done
        logger.info("tensor parallel on Ray: %d ranks, gloo at %s:%d", size, host, port)

    def _get(self, refs, timeout: float):
        try:
            return ray.get(refs, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise WorkerDied(
                f"tensor-parallel ranks on Ray not ready after {timeout:.0f} s (does the "
                f"cluster have {len(self.actors)} free CPUs?)"
            ) from None
        except ray.exceptions.RayError as error:
            raise WorkerDied(f"a tensor-parallel rank on Ray failed: {error}") from error

    def shard(self, model) -> None:
        shard_llama(model, self.rank)
        self._get(self._loaded, LOAD_TIMEOUT_S)

    def rank_hf_config(self, hf_config):
        return rank_kv_config(hf_config, self.rank.size)

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
                    raise WorkerDied(
                        f"tensor-parallel rank {index + 1} (Ray actor, pid {self.pids[index]}) "
                        f"died: {type(error).__name__}"
                    ) from error
            self._in_flight[index] = actor.ping.remote()

    def broadcast_step(self, input_ids, positions, metadata, logits_indices) -> None:
        self.check()
        payload = pickle.dumps((input_ids, positions, metadata, logits_indices), protocol=5)
        for actor in self.actors:
            actor.step.remote(payload)  # after the ping: its failure is seen by the next check

    def close(self) -> None:
        for actor in self.actors:
            ray.kill(actor)
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
