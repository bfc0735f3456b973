"""A tensor-parallel worker: ranks 1..N-1, each a process of its own (``executor.py``).

It loads the model as the engine does, keeps its shard (before the CPU packing, as rank 0;
on CUDA then moved to its device), allocates its part of the KV cache (its KV heads of every
block), then runs the forward of each step rank 0 sends it, until rank 0 says stop or its pipe
closes. On CUDA, where ``--gpu-memory-utilization`` sizes the KV cache, it profiles the same
step as rank 0 after it reports ready (the step's collectives join them) and takes the fewest
blocks any rank has room for.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import signal

import torch

from llmrpc.engine.parallel.devices import map_step, min_across_ranks, rank_device
from llmrpc.engine.parallel.executor import join_group, rank_kv_config, rank_threads
from llmrpc.engine.parallel.layers import Collectives, Rank, shard_llama

logger = logging.getLogger(__name__)


def main(
    config,
    rank: int,
    port: int,
    conn,
    log_level: int,
    device_type: str = "cpu",
    profile_tokens: int | None = None,
) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine decides when its ranks stop
    logging.basicConfig(
        level=log_level,
        format=f"%(asctime)s %(levelname)s tp-rank{rank} %(name)s: %(message)s",
    )
    try:
        size = config.parallel.tensor_parallel_size
        device = rank_device(device_type, rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        torch.set_num_threads(rank_threads(size))
        conn.send("started")
        join_group(rank, size, port, device=device)
        shard = Shard(config, Collectives(Rank(rank, size)), device)
        if profile_tokens is None:
            shard.allocate_kv_cache()
            conn.send("ready")
        else:  # rank 0 profiles once every shard is loaded: the step's collectives join them
            conn.send("ready")
            shard.size_kv_cache(profile_tokens)
        _serve(conn, shard)
    except BaseException as error:  # noqa: BLE001 - reported to rank 0, then this rank ends
        logger.exception("tensor-parallel rank %d failed", rank)
        with contextlib.suppress(OSError):  # rank 0 may be gone
            conn.send(("error", repr(error)))
        os._exit(1)
    os._exit(0)  # no interpreter teardown: nothing is left to save


class Shard:
    """One worker rank's part of the model and of the KV cache, on its device."""

    def __init__(self, config, comm: Collectives, device: torch.device) -> None:
        from llmrpc.engine.core import engine_core as core
        from llmrpc.engine.loading import loader
        from llmrpc.engine.models import build_model, unstack_experts
        from llmrpc.engine.runner.device import HostStaging

        self.config, self.comm, self.device = config, comm, device
        model_config = config.model
        model_dir = loader.resolve_model_dir(model_config.model)
        self.hf_config = core.apply_config_overrides(loader.load_hf_config(model_dir), model_config)
        self.dtype = core.resolve_dtype(model_config.dtype, self.hf_config)
        self.kv_dtype = core._KV_CACHE_DTYPES.get(config.cache.cache_dtype, self.dtype)
        self.kv_config = rank_kv_config(self.hf_config, comm.rank.size)
        dummy = model_config.load_format == "dummy"
        weights = None if dummy else loader.iter_weights(model_dir)
        model = build_model(
            self.hf_config, self.dtype, weights, model_config.seed, model_config.model_impl
        )
        shard_llama(model, comm, config.parallel.enable_expert_parallel)
        if device.type == "cpu":
            from llmrpc.engine.runner.weight_arena import gather_weights
            from llmrpc.kernels import cpu_ops
            from llmrpc.kernels.linear import pack_linear_layers
            from llmrpc.kernels.linear_tuning import layouts, plan_linear_kernels

            if self._attention_backend() == "torch":  # as rank 0 (engine_core._load_model)
                unstack_experts(model)
            # the same shard shapes as rank 0's: its measurements, where it has cached them
            plan = plan_linear_kernels(
                model, loader.cache_root() / "kernels", uniform=model_config.batch_invariant
            )
            pack_linear_layers(model, layouts(plan))
            gather_weights(model)  # as rank 0's, in one buffer in step order
            cpu_ops.load()  # the C++ decode attention, as rank 0 uses it
        else:
            model = model.to(device)
        self.model = model
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        # the step's inputs arrive on the host: staged in pinned buffers, copied without blocking
        self.staging = None if device.type == "cpu" else HostStaging(device)

    def allocate_kv_cache(self) -> None:
        """As many blocks as rank 0 has, known without profiling (``--kv-cache-memory`` for the
        whole model's KV heads, or ``--num-gpu-blocks-override``)."""
        from llmrpc.engine.core import engine_core as core

        num_blocks = core.num_kv_blocks(self.config.cache, self.hf_config, self.kv_dtype)
        self.kv_caches = self._runner(num_blocks).kv_caches
        shape = list(self.kv_caches[0][0].shape)
        logger.info("rank %d: shard loaded, KV cache %s per layer", self.comm.rank.rank, shape)

    def size_kv_cache(self, profile_tokens: int) -> None:
        """Profile the step rank 0 profiles, measure what this device has left for KV blocks,
        and allocate the fewest blocks any rank has room for."""
        runner = self._runner(-(-profile_tokens // self.config.cache.block_size))
        num_blocks = runner.kv_blocks_on_device(
            profile_tokens,
            self.config.scheduler.max_num_seqs,
            self.config.cache.gpu_memory_utilization,
        )
        num_blocks = min_across_ranks(num_blocks, self.device)
        runner.resize_kv_cache(num_blocks)
        self.kv_caches = runner.kv_caches
        logger.info("rank %d: shard loaded, %d KV blocks", self.comm.rank.rank, num_blocks)

    def _runner(self, num_blocks: int):
        """A ``ModelRunner`` of this shard: the engine's own KV cache allocation (zero-filled;
        on the host calloc'd, resident only as blocks are written) and device profiling."""
        from llmrpc.engine.runner.model_runner import ModelRunner

        return ModelRunner(
            self.model,
            self.kv_config,
            num_blocks,
            self.config.cache.block_size,
            self.kv_dtype,
            self._attention_backend(),
        )

    def _attention_backend(self) -> str:
        from llmrpc.engine.runner.device import resolve_attention_backend

        return resolve_attention_backend(self.config.model.attention_backend, self.device)

    def run_step(self, data: bytes) -> bool:
        """Run the forward of one step rank 0 pickled; False for its stop message."""
        step = pickle.loads(data)
        if step is None:
            return False
        if self.staging is not None:
            stage = self.staging.to_device
            step = map_step(step, lambda name, tensor: stage(name, tensor, tensor.dtype))
        input_ids, positions, metadata, logits_indices = step
        with torch.inference_mode():
            hidden = self.model(input_ids, positions, self.kv_caches, metadata)
            self.model.compute_logits(hidden[logits_indices])  # this rank's part of the gather
        return True


def _serve(conn, shard: Shard) -> None:
    while True:
        try:
            data = conn.recv_bytes()
        except EOFError:  # rank 0's process is gone
            return
        if not shard.run_step(data):
            return
