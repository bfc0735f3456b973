"""The experts of a Mixture-of-Experts block: routing (``route``) and the fused experts layer
(``fused_experts``), with its torch twin.

Every token goes to ``k`` of ``E`` experts. An expert is a gated MLP held in stacked weights,
``w13 [E, 2*I, H]`` (its gate rows, then its up rows: Transformers 5's ``experts.gate_up_proj``)
and ``w2 [E, H, I]`` (``experts.down_proj``). For token ``t`` and its slots ``j``::

    out[t] = sum_j topk_weights[t, j] * w2[e] @ (silu(g) * u),  [g; u] = w13[e] @ hidden[t],
    e = topk_ids[t, j]

A slot whose id is -1 adds nothing (expert parallelism: a rank maps the experts it does not hold
to -1). Ids are otherwise in ``[0, E)``; that is not checked (reading the ids needs a host sync).

``backend`` picks the path: "torch" (the twin here, which the CPU engine runs) or "triton"
(``kernel_ops/triton_moe.py``, grouped GEMMs, on CUDA or interpreted on the CPU). Both take the
matmuls and the activation in the hidden dtype, as Transformers' experts do, and sum the
weighted expert outputs in float32, rounding once at the end.

The twin groups the (token, slot) pairs by expert (a stable sort of the ids, a count per
expert), then runs one matmul per projection for each expert that has tokens (a loop over
experts, never over tokens), and adds the weighted rows back with one ``index_add_``. Its loop
length depends on the data, so ``torch.compile`` must not trace into it: under compilation
``fused_experts`` calls the operation ``torch.ops.llmrpc.fused_experts`` (registered here, with a
shape-only fake), one opaque node of the graph whichever the backend; eager calls skip the
dispatcher.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F

from llmrpc.kernels.elementwise import silu_and_mul

BACKENDS = ("torch", "triton")


def route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(topk_weights float32 [T, k], topk_ids int32 [T, k])`` from ``router_logits [T, E]``:
    a float32 softmax over the experts, ``torch.topk`` of it (ties go where ``torch.topk`` puts
    them, as in Transformers' routers), and, with ``renormalize``, the k weights scaled to sum
    to 1."""
    if not 1 <= top_k <= router_logits.shape[-1]:
        raise ValueError(f"top_k must be 1 to {router_logits.shape[-1]}, got {top_k}")
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def fused_experts(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    backend: str = "torch",
) -> torch.Tensor:
    """``[T, H]`` in ``hidden``'s dtype: the sum over each token's slots of the routing weight
    times its expert's output (module docstring). ``hidden [T, H]``, ``w13 [E, 2*I, H]``,
    ``w2 [E, H, I]``, ``topk_weights`` float32 ``[T, k]``, ``topk_ids`` int32/int64 ``[T, k]``
    in ``[0, E)`` or -1."""
    _check(hidden, w13, w2, topk_weights, topk_ids, backend)
    if torch.compiler.is_compiling():
        return _fused_experts_op(hidden, w13, w2, topk_weights, topk_ids, backend)
    return _run(hidden, w13, w2, topk_weights, topk_ids, backend)


def _run(hidden, w13, w2, topk_weights, topk_ids, backend) -> torch.Tensor:
    if backend == "triton":
        from llmrpc.kernels import triton_moe

        return triton_moe.fused_experts(hidden, w13, w2, topk_weights, topk_ids)
    return fused_experts_torch(hidden, w13, w2, topk_weights, topk_ids)


@torch.library.custom_op("llmrpc::fused_experts", mutates_args=())
def _fused_experts_op(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    backend: str,
) -> torch.Tensor:
    return _run(hidden, w13, w2, topk_weights, topk_ids, backend)


@_fused_experts_op.register_fake
def _(hidden, w13, w2, topk_weights, topk_ids, backend):
    return torch.empty_like(hidden)  # [T, H]


def fused_experts_torch(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """The twin of ``fused_experts``: pairs grouped by expert, two matmuls per expert with
    tokens, one scatter-add in float32. One host sync (the per-expert counts)."""

    def expert(index: int, rows: torch.Tensor) -> torch.Tensor:
        return F.linear(silu_and_mul(F.linear(rows, w13[index])), w2[index])

    return grouped_experts(hidden, topk_weights, topk_ids, w13.shape[0], expert)


def grouped_experts(
    hidden: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    expert: Callable[[int, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """``fused_experts`` with each expert a function: ``expert(e, rows [n, H]) -> [n, H]`` (the
    CPU's experts held as packed or quantized linear layers, one per expert and projection).
    The (token, slot) pairs are grouped by expert, ``expert`` called once for each expert with
    pairs, the weighted rows added back in float32 with one ``index_add_``."""
    num_tokens, top_k = topk_ids.shape
    hidden_size = hidden.shape[1]
    if num_tokens == 1:  # one stream's decode: nothing to group (the sums in the same order)
        return _one_token(hidden, topk_weights, topk_ids, expert)
    out = torch.zeros(num_tokens, hidden_size, dtype=torch.float32, device=hidden.device)
    ids = topk_ids.reshape(-1)
    # [T*k] pair indices (t * k + j), grouped by expert; the dropped ones (-1) sort first
    order = torch.argsort(ids, stable=True)
    counts = torch.bincount(ids.long() + 1, minlength=num_experts + 1).tolist()
    order = order[counts[0] :]
    tokens = order // top_k
    x = hidden.index_select(0, tokens)  # [N, H], N = pairs kept
    y = torch.empty(x.shape[0], hidden_size, dtype=torch.float32, device=hidden.device)
    start = 0
    for index, count in enumerate(counts[1:]):
        if count == 0:
            continue
        end = start + count
        y[start:end] = expert(index, x[start:end])  # rounded, then widened
        start = end
    y.mul_(topk_weights.reshape(-1)[order].float()[:, None])
    out.index_add_(0, tokens, y)
    return out.to(hidden.dtype)


def _one_token(hidden, topk_weights, topk_ids, expert) -> torch.Tensor:
    """``grouped_experts`` of one token without the sort, gathers and scatter (a block of
    tests/bench/moe_bench.py at 1 row: 0.67 ms against 0.77 on a 2-core Xeon): its experts'
    weighted outputs added in float32 in the order the grouping adds them, by expert id."""
    out = torch.zeros(1, hidden.shape[1], dtype=torch.float32, device=hidden.device)
    for slot, index in sorted(enumerate(topk_ids[0].tolist()), key=lambda pair: pair[1]):
        if index >= 0:
            out += expert(index, hidden).float() * topk_weights[0, slot].float()
    return out.to(hidden.dtype)


class ExpertLayers(Protocol):
    """Experts held one linear layer per expert and projection (``grouped_experts``' form)."""

    num_experts: int

    def expert(self, index: int, rows: torch.Tensor) -> torch.Tensor: ...


# name -> experts, for the operation below (a compiled graph holds the name, not the module)
_EXPERT_LAYERS: weakref.WeakValueDictionary[str, ExpertLayers] = weakref.WeakValueDictionary()


def register_expert_layers(experts: ExpertLayers) -> str:
    """The name under which ``experts_by_layer`` finds ``experts`` while they live."""
    name = f"experts-{id(experts)}"
    _EXPERT_LAYERS[name] = experts
    return name


def experts_by_layer(
    hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, layer: str
) -> torch.Tensor:
    """``grouped_experts`` over the experts registered as ``layer``; under ``torch.compile`` one
    opaque operation (``torch.ops.llmrpc.experts_by_layer``), as ``fused_experts`` is."""
    if torch.compiler.is_compiling():
        return _experts_by_layer_op(hidden, topk_weights, topk_ids, layer)
    return _by_layer(hidden, topk_weights, topk_ids, layer)


def _by_layer(hidden, topk_weights, topk_ids, layer: str) -> torch.Tensor:
    experts = _EXPERT_LAYERS[layer]
    return grouped_experts(hidden, topk_weights, topk_ids, experts.num_experts, experts.expert)


@torch.library.custom_op("llmrpc::experts_by_layer", mutates_args=())
def _experts_by_layer_op(
    hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, layer: str
) -> torch.Tensor:
    return _by_layer(hidden, topk_weights, topk_ids, layer)


@_experts_by_layer_op.register_fake
def _(hidden, topk_weights, topk_ids, layer):
    return torch.empty_like(hidden)


def _check(hidden, w13, w2, topk_weights, topk_ids, backend) -> None:
    """Shapes, dtypes and ``backend`` (``ValueError`` naming the argument); read from shapes
    only, so a compiled forward checks them while tracing and never again."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be [T, H], got shape {tuple(hidden.shape)}")
    num_tokens, hidden_size = hidden.shape
    if w13.dim() != 3 or w13.shape[2] != hidden_size or w13.shape[1] % 2:
        raise ValueError(f"w13 must be [E, 2*I, {hidden_size}], got shape {tuple(w13.shape)}")
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    if w2.shape != (num_experts, hidden_size, inter):
        expected = (num_experts, hidden_size, inter)
        raise ValueError(f"w2 must be {expected} [E, H, I], got shape {tuple(w2.shape)}")
    for name, weight in (("w13", w13), ("w2", w2)):
        if weight.dtype != hidden.dtype:
            raise ValueError(f"{name} is {weight.dtype}, expected hidden's {hidden.dtype}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != num_tokens:
        raise ValueError(f"topk_ids must be [{num_tokens}, k], got shape {tuple(topk_ids.shape)}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids is {topk_ids.dtype}, expected torch.int32 or torch.int64")
    if topk_weights.shape != topk_ids.shape or not topk_weights.is_floating_point():
        raise ValueError(
            f"topk_weights must be float {tuple(topk_ids.shape)} as topk_ids, got "
            f"{topk_weights.dtype} {tuple(topk_weights.shape)}"
        )
