"""Tensor-parallel layers, and the sharding of a loaded native Llama-family model.

Megatron's split: each rank holds a slice of the attention heads and of the MLP's intermediate
features. ``qkv_proj`` and ``gate_up_proj`` are column-parallel (each rank keeps its rows of
each fused slice, so its output is its heads' q|k|v, its features' gate|up: no communication);
``o_proj`` and ``down_proj`` are row-parallel (each rank multiplies its input columns, one
all-reduce sums the partial products). The embedding and LM head split the vocabulary. So one
forward pass costs two all-reduces per layer, one for the embedding and one gather of logits.

Sharded layers stay plain ``nn.Linear`` inside, so CPU packing (``pack_linear_layers``) runs
after sharding exactly as on one rank. Their communication goes through one ``Collectives`` per
rank (gloo on the CPU, NCCL on CUDA).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class Rank:
    rank: int
    size: int


class WorkerDied(RuntimeError):
    pass


class Collectives:
    """This rank's all-reduces and its part of the logits gather.

    Gloo fails a collective whose peer's socket closed; NCCL waits for a dead peer forever. So on
    CUDA the executor watches the other ranks and, when one dies, records it in ``failure`` and
    aborts the process group, which releases the collective waiting for it: from then on each
    collective raises ``WorkerDied`` naming the rank rather than NCCL's error, and rank 0
    (``sync_gather``) waits for the step's device work after the gather and checks ``failure``
    before it returns the logits, so logits computed over an aborted group never get out. That
    wait is one more host wait per step on CUDA; the sampler's read-back of the step's tokens,
    which waits for the same work, follows it.
    """

    def __init__(self, rank: Rank, sync_gather: bool = False) -> None:
        self.rank = rank
        self.sync_gather = sync_gather
        self.failure: str | None = None  # set by the executor's watcher (CUDA only)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        try:
            dist.all_reduce(tensor)
        except Exception as error:  # noqa: BLE001 - re-raised, as WorkerDied where a rank died
            self._reraise(error)

    def gather(self, local: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's ``local`` on rank 0 (in rank order); None on the other ranks."""
        parts = None
        if self.rank.rank == 0:
            parts = [torch.empty_like(local) for _ in range(self.rank.size)]
        try:
            dist.gather(local, parts, dst=0)
        except Exception as error:  # noqa: BLE001 - as in all_reduce
            self._reraise(error)
        if self.sync_gather and parts is not None:
            torch.cuda.current_stream(local.device).synchronize()
            self.raise_if_failed()
        return parts

    def raise_if_failed(self) -> None:
        if self.failure is not None:
            raise WorkerDied(self.failure)

    def _reraise(self, error: Exception):
        if self.failure is not None:
            raise WorkerDied(self.failure) from error
        raise error


class RowParallelLinear(nn.Module):
    """``y = all_reduce(x_r W_r^T) + b``: the input arrives split by columns (this rank's heads
    or features), the output is whole on every rank. The bias is added once, after the sum."""

    def __init__(self, linear: nn.Linear, comm: Collectives) -> None:
        super().__init__()
        rank, self.comm = comm.rank, comm
        per_rank = linear.in_features // rank.size
        start = rank.rank * per_rank
        self.linear = nn.Linear(per_rank, linear.out_features, bias=False, device="meta")
        self.linear.weight = nn.Parameter(
            linear.weight.detach()[:, start : start + per_rank].contiguous(), False
        )
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x)
        self.comm.all_reduce(out)
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Module):
    """Each rank holds rows ``[start, start + per_rank)`` of the table; ids outside them give
    zeros there, and one all-reduce gives every rank the whole lookup."""

    def __init__(self, weight: nn.Parameter, start: int, num_rows: int, comm: Collectives) -> None:
        super().__init__()
        self.start, self.num_rows, self.comm = start, num_rows, comm
        self.embedding = nn.Embedding(weight.shape[0], weight.shape[1], device="meta")
        self.embedding.weight = weight  # the tied LM head's shard too, where it is tied

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_rows)
        hidden = self.embedding(local.masked_fill(outside, 0))
        hidden = hidden.masked_fill(outside.unsqueeze(-1), 0)
        self.comm.all_reduce(hidden)
        return hidden


class ParallelLMHead(nn.Module):
    """Logits of this rank's vocabulary rows, gathered to rank 0, which returns all of them
    (``[rows, vocab_size]``); the other ranks return their own slice, which nothing reads."""

    def __init__(self, weight: nn.Parameter, vocab_size: int, comm: Collectives) -> None:
        super().__init__()
        self.linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
        self.linear.weight = weight
        self.vocab_size, self.comm = vocab_size, comm

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local = self.linear(hidden).contiguous()
        parts = self.comm.gather(local)
        if parts is None:
            return local
        return torch.cat(parts, dim=-1)[..., : self.vocab_size]


def vocab_shard(weight: torch.Tensor, rank: Rank) -> tuple[nn.Parameter, int, int]:
    """This rank's rows of a ``[vocab, hidden]`` table, zero-padded so every rank holds the
    same number (the gather needs equal parts): ``(rows, start, real rows)``."""
    vocab = weight.shape[0]
    per_rank = -(-vocab // rank.size)
    start = rank.rank * per_rank
    rows = weight.detach()[start : start + per_rank]
    padded = torch.zeros(per_rank, weight.shape[1], dtype=weight.dtype, device=weight.device)
    padded[: rows.shape[0]] = rows
    return nn.Parameter(padded, False), start, rows.shape[0]


def column_shard(linear: nn.Linear, slices: list[tuple[int, int]]) -> nn.Linear:
    """A linear layer of this rank's output rows: ``(offset, size)`` of each fused slice."""
    weight = torch.cat([linear.weight.detach()[o : o + n] for o, n in slices])
    out = nn.Linear(linear.in_features, weight.shape[0], linear.bias is not None, device="meta")
    out.weight = nn.Parameter(weight.contiguous(), False)
    if linear.bias is not None:
        out.bias = nn.Parameter(torch.cat([linear.bias.detach()[o : o + n] for o, n in slices]))
    return out.requires_grad_(False)


def kv_heads_per_rank(num_kv_heads: int, size: int) -> int:
    """KV heads each rank holds: its share, or one (replicated) when there are fewer than ranks."""
    return max(1, num_kv_heads // size)


def check_shardable(hf_config, size: int, expert_parallel: bool = False) -> None:
    """Refuse, with one line, a model whose heads, features or experts do not split over
    ``size``."""
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", heads)
    problems = []
    if heads % size:
        problems.append(f"{heads} attention heads")
    if kv_heads >= size and kv_heads % size or kv_heads < size and size % kv_heads:
        problems.append(f"{kv_heads} KV heads")
    if hf_config.intermediate_size % size:
        problems.append(f"intermediate size {hf_config.intermediate_size}")
    experts = getattr(hf_config, "num_local_experts", None) or getattr(hf_config, "num_experts", 0)
    if experts and expert_parallel and experts % size:
        problems.append(f"{experts} experts (--enable-expert-parallel)")
    expert_size = getattr(hf_config, "moe_intermediate_size", None)  # else intermediate_size
    if experts and not expert_parallel and expert_size and expert_size % size:
        problems.append(f"expert intermediate size {expert_size}")
    shared = getattr(hf_config, "shared_expert_intermediate_size", None)
    if experts and shared and shared % size:
        problems.append(f"shared expert intermediate size {shared}")
    if getattr(hf_config, "model_type", None) == "olmoe":
        raise ValueError(
            f"--tensor-parallel-size {size}: OLMoE's q and k norms span every head, which this "
            "build does not split over ranks"
        )
    if problems:
        raise ValueError(
            f"--tensor-parallel-size {size}: the model's {', '.join(problems)} do not split "
            f"evenly over {size} ranks"
        )


def shard_llama(model: nn.Module, comm: Collectives, expert_parallel: bool = False) -> None:
    """Keep this rank's part of a loaded native Llama-family model, in place; its collectives
    go through ``comm``. A MoE block's experts are split whole over the ranks with
    ``expert_parallel`` (``--enable-expert-parallel``), else by their intermediate features."""
    rank, config = comm.rank, model.config
    check_shardable(config, rank.size, expert_parallel)
    for layer in model.layers:
        _shard_attention(layer.self_attn, comm)
        mlp = layer.mlp
        if hasattr(mlp, "experts"):  # engine/models/moe.SparseMoeBlock
            _shard_moe(mlp, comm, expert_parallel)
            continue
        _shard_mlp(mlp, comm, reduce=True)
    tied = model.lm_head.weight is model.embed_tokens.weight
    weight, start, num_rows = vocab_shard(model.embed_tokens.weight, rank)
    model.embed_tokens = VocabParallelEmbedding(weight, start, num_rows, comm)
    if not tied:
        weight = vocab_shard(model.lm_head.weight, rank)[0]
    model.lm_head = ParallelLMHead(weight, config.vocab_size, comm)


def _shard_mlp(mlp: nn.Module, comm: Collectives, reduce: bool) -> None:
    """This rank's intermediate features of a SiLU MLP: its rows of gate and up, its columns of
    down, whose partial product is all-reduced with ``reduce`` (else the caller reduces it)."""
    rank, full = comm.rank, mlp.intermediate_size
    per_rank = full // rank.size
    start = rank.rank * per_rank
    mlp.gate_up_proj = column_shard(mlp.gate_up_proj, [(start, per_rank), (full + start, per_rank)])
    mlp.intermediate_size = per_rank
    if reduce:
        mlp.down_proj = RowParallelLinear(mlp.down_proj, comm)
        return
    down = mlp.down_proj
    if down.bias is not None:  # would be added on every rank before the caller's sum
        raise ValueError("a shared expert with a down_proj bias is not sharded in this build")
    sliced = nn.Linear(per_rank, down.out_features, bias=False, device="meta")
    sliced.weight = nn.Parameter(
        down.weight.detach()[:, start : start + per_rank].contiguous(), False
    )
    mlp.down_proj = sliced


def _shard_moe(block: nn.Module, comm: Collectives, expert_parallel: bool) -> None:
    """Every rank routes every token; its block returns its part of the sum (its experts, or
    its features of every expert, and its features of the shared expert), all-reduced once."""
    rank, experts = comm.rank, block.experts
    w13, w2 = experts.w13.detach(), experts.w2.detach()
    if expert_parallel:
        per_rank = experts.num_experts // rank.size
        start = rank.rank * per_rank
        w13, w2 = w13[start : start + per_rank], w2[start : start + per_rank]
        experts.num_experts, experts.first_expert = per_rank, start
    else:
        full = experts.intermediate_size
        per_rank = full // rank.size
        start = rank.rank * per_rank
        w13 = torch.cat((w13[:, start : start + per_rank], w13[:, full + start :][:, :per_rank]), 1)
        w2 = w2[:, :, start : start + per_rank]
        experts.intermediate_size = per_rank
    experts.w13 = nn.Parameter(w13.contiguous(), False)
    experts.w2 = nn.Parameter(w2.contiguous(), False)
    if block.shared_expert is not None:
        _shard_mlp(block.shared_expert, comm, reduce=False)
    block.comm = comm


def _shard_attention(attn: nn.Module, comm: Collectives) -> None:
    rank = comm.rank
    heads = attn.num_heads // rank.size
    kv_heads = kv_heads_per_rank(attn.num_kv_heads, rank.size)
    # ranks that share a replicated KV head (fewer KV heads than ranks) take the same one
    first_kv = rank.rank * attn.num_kv_heads // rank.size
    dim = attn.head_dim
    q_rows = (rank.rank * heads * dim, heads * dim)
    k_rows = (attn.q_size + first_kv * dim, kv_heads * dim)
    v_rows = (attn.q_size + attn.kv_size + first_kv * dim, kv_heads * dim)
    attn.qkv_proj = column_shard(attn.qkv_proj, [q_rows, k_rows, v_rows])
    attn.o_proj = RowParallelLinear(attn.o_proj, comm)
    attn.num_heads, attn.num_kv_heads = heads, kv_heads
    attn.q_size, attn.kv_size = heads * dim, kv_heads * dim
