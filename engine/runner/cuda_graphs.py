"""CUDA graphs of the model's forward for decodes-only steps (``--cuda-graph-sizes``,
``--max-seq-len-to-capture``).

On a GPU a decode step of a small batch can take longer to launch, its few hundred kernels one
by one from Python, than to run. At start-up, on a CUDA device with the Triton attention backend,
the forward is captured once per batch-size bucket; a step whose every row is a decode
(``AttentionMetadata.decodes_only``) then copies its inputs into the graphs' static buffers and
replays the graph of the smallest bucket that holds it: one launch for the whole forward. With
``-O1`` to ``-O3`` the forward captured is the ``torch.compile``d one
(``engine/runner/compilation.py``, compiled before the capture): inductor's fused kernels, launched
by the graph.

- Buckets: vLLM's ``--cuda-graph-sizes`` (``capture_sizes``), each capped at ``--max-num-seqs``.
- Static buffers, on the device, sized for the largest bucket: ``input_ids``, ``positions``,
  ``slot_mapping``, ``decode_indices``, ``decode_block_tables`` ``[max_bucket, width]`` and
  ``decode_seq_lens``. ``width`` holds ``--max-seq-len-to-capture`` tokens (capped at the
  model's length): a fixed width is a fixed launch grid for the decode kernel, whose split count
  follows the table's width and the bucket's rows. A step with a longer context runs eager.
- A step of ``n`` rows in a bucket of ``size``: rows ``n..size-1`` are padding, slot -1 (the KV
  store skips it), context length 1 and a block table of zeros (block 0's first slot is read and
  the result dropped); the replay's first ``n`` rows are the step's hidden states.
- Capture runs after the KV cache is allocated and before the engine reports ready, largest
  bucket first, every graph in one memory pool, each after a warm-up run of the same shapes
  (Triton compiles there). A graph holds the addresses of the KV cache and the weights: freeing
  either drops the graphs (``ModelRunner``), and waking up captures them again.
- A failure raised in Python, in a capture (an operation the capture does not permit, no
  memory for the graph) or in a replay before the device runs it (filling the static buffers,
  the launch), is logged once, the graphs are dropped and decode steps run eager from
  then on (a step whose replay raised runs again eager). A fault on the device (an illegal
  address, a kernel's trap) is not recovered from: CUDA keeps its error in the process (sticky),
  so every later launch, eager ones included, fails too, and the step fails as any failed forward
  does. A replay runs asynchronously, so such a fault surfaces at a later synchronisation (the
  step's read-back), not necessarily in the replay. The CPU tests' stand-in fails in Python only.

The capture mechanism is a parameter (``CudaGraphCapture`` on a device); the CPU tests give a
stand-in whose replay runs the captured forward again on the same static buffers.
"""

from __future__ import annotations

import bisect
import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from llmrpc.engine.config import EngineConfig
from llmrpc.engine.models.transformers_impl import TransformersForCausalLM
from llmrpc.engine.runner.device import model_device
from llmrpc.kernels.attention import AttentionMetadata

logger = logging.getLogger(__name__)

# vLLM's default largest size: min(2 * --max-num-seqs, this)
_DEFAULT_LARGEST_SIZE = 512


def capture_sizes(cuda_graph_sizes: tuple[int, ...], max_num_seqs: int) -> tuple[int, ...]:
    """The batch sizes to capture, ascending: ``--cuda-graph-sizes`` as vLLM reads it (none:
    ``[min(2 * max_num_seqs, 512)]``; one value N: 1, 2, 4, then the multiples of 8, up to N;
    several: those), each capped at ``max_num_seqs`` (a larger one becomes ``max_num_seqs``: no
    step has more decode rows than requests)."""
    sizes = list(cuda_graph_sizes) or [min(2 * max_num_seqs, _DEFAULT_LARGEST_SIZE)]
    if len(sizes) == 1:
        largest = sizes[0]
        sizes = [s for s in (1, 2, 4) if s <= largest] + list(range(8, largest + 1, 8))
    return tuple(sorted({min(size, max_num_seqs) for size in sizes}))


@dataclass(frozen=True)
class DecodeGraphPlan:
    """What to capture: the batch-size buckets and the longest context a replayed step takes."""

    sizes: tuple[int, ...]  # ascending
    max_seq_len: int


def plan_decode_graphs(
    config: EngineConfig,
    device: torch.device,
    model: nn.Module,
    backend: str,
    max_model_len: int,
) -> DecodeGraphPlan | None:
    """The graphs to capture, or None: decode steps run eager (on a CUDA device, the reason is
    logged once; on the CPU there is nothing to say)."""
    if device.type != "cuda":
        return None
    why_not = why_not_captured(
        model,
        backend,
        enforce_eager=config.compilation.enforce_eager,
        lora_enabled=config.lora.enabled,
        tensor_parallel_size=config.parallel.tensor_parallel_size,
    )
    if why_not is not None:
        logger.warning("decode steps run eager, not as CUDA graphs: %s", why_not)
        return None
    sizes = capture_sizes(config.compilation.cuda_graph_sizes, config.scheduler.max_num_seqs)
    return DecodeGraphPlan(sizes, min(config.compilation.capture_len, max_model_len))


def why_not_captured(
    model: nn.Module,
    backend: str,
    *,
    enforce_eager: bool,
    lora_enabled: bool,
    tensor_parallel_size: int,
) -> str | None:
    """Why the decode steps of ``model`` on a CUDA device are not captured, or None."""
    if enforce_eager:
        return "--enforce-eager"
    if backend != "triton":
        return f"--attention-backend {backend} (graphs are captured with triton only)"
    if isinstance(model, TransformersForCausalLM):
        return "the Transformers implementation (--model-impl transformers)"
    if not getattr(model, "uses_kv_cache", True):
        return "an encoder's steps are not decodes"
    if lora_enabled:
        return "--enable-lora (a step's adapters are chosen per row on the host)"
    if tensor_parallel_size > 1:
        return f"--tensor-parallel-size {tensor_parallel_size}"
    return None


Forward = Callable[[], torch.Tensor]


class GraphCapture(Protocol):
    """How a forward over fixed buffers is captured and replayed."""

    def warm_up(self, forward: Forward) -> None: ...

    def capture(self, forward: Forward) -> tuple[Callable[[], None], torch.Tensor]:
        """``(replay, output)``: ``replay()`` runs the forward again on the buffers it read,
        writing its result into ``output``."""
        ...


class CudaGraphCapture:
    """``torch.cuda.CUDAGraph`` captures on ``device``, every graph in one memory pool."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pool = None

    def warm_up(self, forward: Forward) -> None:
        # on a side stream, as capture runs on one: lazy initialisations happen outside it
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            forward()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)

    def capture(self, forward: Forward) -> tuple[Callable[[], None], torch.Tensor]:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            output = forward()
        torch.cuda.synchronize(self.device)
        return graph.replay, output


class _StaticInputs:
    """The graphs' input buffers on the device, ``size`` rows and ``width`` table columns."""

    def __init__(self, size: int, width: int, device: torch.device) -> None:
        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.long, device=device)

        self.input_ids = zeros(size)
        self.positions = zeros(size)
        self.slot_mapping = torch.full((size,), -1, dtype=torch.long, device=device)
        self.decode_indices = torch.arange(size, device=device)  # decodes-only: row i is row i
        self.decode_block_tables = zeros(size, width)
        self.decode_seq_lens = torch.ones(size, dtype=torch.long, device=device)

    def metadata(self, size: int, backend: str) -> AttentionMetadata:
        """The attention metadata of a ``size``-row graph: views of the buffers' first rows."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            decode_indices=self.decode_indices[:size],
            decode_block_tables=self.decode_block_tables[:size],
            decode_seq_lens=self.decode_seq_lens[:size],
            prefills=[],
            decodes_only=True,
            backend=backend,
            padded=True,
        )

    def fill(self, size: int, input_ids, positions, metadata: AttentionMetadata) -> None:
        """The step's ``n`` rows, then padding up to ``size``: copies on the device, no sync."""
        n = input_ids.shape[0]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(metadata.slot_mapping)
        self.slot_mapping[n:size].fill_(-1)
        self.decode_seq_lens[:n].copy_(metadata.decode_seq_lens)
        self.decode_seq_lens[n:size].fill_(1)
        # padding rows, and columns past the step's widest table, hold block 0 as eager pads
        step_tables, width = metadata.decode_block_tables, metadata.decode_block_tables.shape[1]
        self.decode_block_tables[:n, :width].copy_(step_tables)
        self.decode_block_tables[:n, width:].zero_()
        self.decode_block_tables[n:size].zero_()


class DecodeGraphs:
    """The model's forward captured at each bucket of ``plan``; ``__call__`` answers the hidden
    states of a qualifying step, or None: run it eager."""

    def __init__(
        self,
        model: nn.Module,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        plan: DecodeGraphPlan,
        backend: str,
        capture: GraphCapture,
        compiled: Callable[..., torch.Tensor | None] | None = None,
    ) -> None:
        """``compiled``: the ``torch.compile``d forward (``CompiledDecode``, ``-O1`` to ``-O3``)
        to capture instead of the eager one where it runs."""
        self.plan = plan
        self.failure: str | None = None
        self.num_replays = 0
        self._model = model
        self._kv_caches = kv_caches
        self._backend = backend
        self._capture = capture
        self._compiled = compiled
        self._device = model_device(model)
        self.width = -(-plan.max_seq_len // block_size)  # block-table columns
        with torch.inference_mode():  # as a step's own inputs: a compiled forward guards on it
            self._inputs = _StaticInputs(plan.sizes[-1], self.width, self._device)
        # size -> (replay, static output [size, hidden_size])
        self._graphs: dict[int, tuple[Callable[[], None], torch.Tensor]] = {}

    @torch.inference_mode()
    def capture_all(self) -> bool:
        """Capture every bucket, largest first; False (logged, nothing kept) if one failed."""
        sizes = self.plan.sizes
        logger.info(
            "capturing CUDA graphs of the decode step: %d batch sizes (%s), contexts up to %d "
            "tokens",
            len(sizes),
            _sizes_text(sizes),
            self.plan.max_seq_len,
        )
        started = time.monotonic()
        reserved = self._reserved_memory()
        try:
            for size in reversed(sizes):
                forward = self._forward(size)
                self._capture.warm_up(forward)
                self._graphs[size] = self._capture.capture(forward)
        except Exception as error:  # noqa: BLE001 - a failure raised here: eager from now on
            self._fail(error, "capturing")
            return False
        seconds = time.monotonic() - started
        if reserved is None:
            logger.info("CUDA graphs captured in %.1f s", seconds)
        else:
            grown = (self._reserved_memory() - reserved) / 2**20
            logger.info("CUDA graphs captured in %.1f s, %.0f MiB of device memory", seconds, grown)
        return True

    def _reserved_memory(self) -> int | None:
        """Device memory torch's allocator holds (None off CUDA), with nothing cached: blocks
        cached for other allocations are not the graphs' pool's to use."""
        if self._device.type != "cuda":
            return None
        gc.collect()
        torch.cuda.empty_cache()
        return torch.cuda.memory_reserved(self._device)

    def _forward(self, size: int) -> Forward:
        inputs = self._inputs
        metadata = inputs.metadata(size, self._backend)
        input_ids, positions = inputs.input_ids[:size], inputs.positions[:size]
        model, kv_caches, compiled = self._model, self._kv_caches, self._compiled
        if compiled is None:
            return lambda: model(input_ids, positions, kv_caches, metadata)

        def compiled_forward() -> torch.Tensor:
            hidden = compiled(input_ids, positions, kv_caches, metadata)
            if hidden is None:  # its compile failed (logged by it): this bucket's graph is eager's
                hidden = model(input_ids, positions, kv_caches, metadata)
            return hidden

        return compiled_forward

    def bucket(self, num_rows: int, max_seq_len: int) -> int | None:
        """The bucket a decodes-only step of ``num_rows`` rows whose longest context is
        ``max_seq_len`` tokens replays, or None (eager)."""
        sizes = self.plan.sizes
        if num_rows == 0 or num_rows > sizes[-1] or max_seq_len > self.plan.max_seq_len:
            return None
        return sizes[bisect.bisect_left(sizes, num_rows)]

    def __call__(
        self, input_ids, positions, metadata: AttentionMetadata, max_seq_len: int
    ) -> torch.Tensor | None:
        """The step's hidden states ``[num_rows, hidden_size]`` (a view of the graph's output,
        valid until the next replay), or None: run it eager."""
        if self.failure is not None or not metadata.decodes_only:
            return None
        num_rows = input_ids.shape[0]
        size = self.bucket(num_rows, max_seq_len)
        if size is None or metadata.decode_block_tables.shape[1] > self.width:
            return None
        try:
            self._inputs.fill(size, input_ids, positions, metadata)
            replay, output = self._graphs[size]
            replay()
        except Exception as error:  # noqa: BLE001 - a failure raised here: eager from now on
            self._fail(error, "replaying")
            return None
        self.num_replays += 1
        return output[:num_rows]

    def _fail(self, error: Exception, doing: str) -> None:
        first_line = (str(error).strip().splitlines() or [""])[0][:300]
        self.failure = f"{type(error).__name__}: {first_line}"
        self._graphs.clear()
        logger.warning(
            "%s a CUDA graph of the decode step failed, decode steps run eager from now on "
            "(unless the device faulted: CUDA's error is sticky, every later step fails): %s",
            doing.capitalize(),
            self.failure,
        )


def _sizes_text(sizes: tuple[int, ...]) -> str:
    if len(sizes) <= 6:
        return ", ".join(map(str, sizes))
    return f"{', '.join(map(str, sizes[:4]))}, ..., {sizes[-1]}"
