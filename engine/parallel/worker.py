"""A tensor-parallel worker: ranks 1..N-1, each a process of its own (``executor.py``).

It loads the model as the engine does, keeps its shard (before the CPU packing, as rank 0),
allocates its part of the KV cache (its KV heads of every block), then runs the forward of
each step rank 0 sends it, until rank 0 says stop or its pipe closes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import signal

import torch

from llmrpc.engine.parallel.executor import join_group, rank_threads
from llmrpc.engine.parallel.layers import Rank, shard_llama

logger = logging.getLogger(__name__)


def main(config, rank: int, port: int, conn, log_level: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine decides when its ranks stop
    logging.basicConfig(
        level=log_level,
        format=f"%(asctime)s %(levelname)s tp-rank{rank} %(name)s: %(message)s",
    )
    try:
        size = config.parallel.tensor_parallel_size
        torch.set_num_threads(rank_threads(size))
        conn.send("started")
        join_group(rank, size, port)
        model, kv_caches = load_shard(config, Rank(rank, size))
        conn.send("ready")
        _serve(conn, model, kv_caches)
    except BaseException as error:  # noqa: BLE001 - reported to rank 0, then this rank ends
        logger.exception("tensor-parallel rank %d failed", rank)
        with contextlib.suppress(OSError):  # rank 0 may be gone
            conn.send(("error", repr(error)))
        os._exit(1)
    os._exit(0)  # no interpreter teardown: nothing is left to save


def load_shard(config, rank: Rank):
    from llmrpc.engine import core, loader
    from llmrpc.engine.model_runner import kv_cache_shape
    from llmrpc.engine.models import build_model
    from llmrpc.engine.parallel.executor import rank_kv_config
    from llmrpc.kernels import cpu_ops
    from llmrpc.kernels.linear import pack_linear_layers

    model_config = config.model
    model_dir = loader.resolve_model_dir(model_config.model)
    hf_config = core.apply_config_overrides(loader.load_hf_config(model_dir), model_config)
    dtype = core.resolve_dtype(model_config.dtype, hf_config)
    kv_dtype = core._KV_CACHE_DTYPES.get(config.cache.cache_dtype, dtype)
    num_blocks = core.num_kv_blocks(config.cache, hf_config, kv_dtype)
    dummy = model_config.load_format == "dummy"
    weights = None if dummy else loader.iter_weights(model_dir)
    model = build_model(hf_config, dtype, weights, model_config.seed, model_config.model_impl)
    shard_llama(model, rank)
    pack_linear_layers(model)
    cpu_ops.load()  # the C++ decode attention, as rank 0 uses it
    shape = kv_cache_shape(
        rank_kv_config(hf_config, rank.size), num_blocks, config.cache.block_size
    )
    kv_caches = [
        (torch.zeros(shape, dtype=kv_dtype), torch.zeros(shape, dtype=kv_dtype))
        for _ in range(hf_config.num_hidden_layers)
    ]
    logger.info("rank %d: shard loaded, KV cache %s per layer", rank.rank, list(shape))
    return model, kv_caches


def _serve(conn, model, kv_caches) -> None:
    while True:
        try:
            data = conn.recv_bytes()
        except EOFError:  # rank 0's process is gone
            return
        if not run_step(model, kv_caches, data):
            return


def run_step(model, kv_caches, data: bytes) -> bool:
    """Run the forward of one step rank 0 pickled; False for its stop message."""
    step = pickle.loads(data)
    if step is None:
        return False
    input_ids, positions, metadata, logits_indices = step
    with torch.inference_mode():
        hidden = model(input_ids, positions, kv_caches, metadata)
        model.compute_logits(hidden[logits_indices])  # this rank's part of the gather
    return True
