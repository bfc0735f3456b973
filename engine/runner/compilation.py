"""``torch.compile`` of the model's forward for decodes-only steps (``-O1`` to ``-O3``).

A step whose every row attends like a decode (decodes, and prompt chunks short enough to run as
rows of the decode kernel: ``AttentionMetadata.decodes_only``) runs the compiled forward; other
steps, and level 0, run eager. On the CPU inductor turns the forward into one C++ function (its
``cpp_wrapper``) that calls oneDNN for the packed linear layers and our kernels for the rest
with no Python between them, which is what a decode step gains: the layers' Python overhead.
With ``--attention-backend triton`` the Triton kernels are operations of the graph
(``kernel_ops/triton_ops.py``); on CUDA, where only that backend is compiled
(``core/engine_core.py`` refuses the torch one), inductor's own kernels do the rest and the CUDA
graphs of ``engine/runner/cuda_graphs.py`` capture the compiled forward.

- One graph serves every step: the token and block-table sizes are marked unbacked, so torch
  neither specializes them (on 1, say) nor recompiles for a new batch size.
- Guards on the model's modules are skipped (a module's attributes do not change once loaded):
  checking them took 0.6-0.8 ms a step, about what compiling saves. ``isolate_recompiles`` keeps
  one compiled forward's graphs to itself, so another model in the same process never runs them.
- The compile runs at start-up (``warm_up``), before the engine reports ready. Inductor keeps
  what it compiled in ``$TORCHINDUCTOR_CACHE_DIR``, by default ``cache_root()/inductor``
  (``~/.cache/llmrpc/inductor``), so a later start reuses it.
- After the warm-up a step that would need a new compile raises instead of compiling (torch's
  ``fail_on_recompile`` stance): a user's request never waits for the compiler.
- Any failure, in building the compiled function (an argument this torch lacks), in the compile
  or in a compiled step, is logged once and the engine runs eager from then on (a compiled step
  that raised runs again eager). That holds for failures Python sees; a compiled step that
  faults on a CUDA device leaves the device's context broken, and no eager step runs after it.
"""

from __future__ import annotations

import inspect
import logging
import os
import time
from pathlib import Path

import torch
from torch import nn

from llmrpc.engine.loading.loader import cache_root
from llmrpc.engine.models.transformers_impl import TransformersForCausalLM
from llmrpc.engine.quantization.layers import QuantizedLinear
from llmrpc.engine.runner.device import model_device
from llmrpc.kernels import attention, cpu_ops
from llmrpc.kernels.attention import AttentionMetadata
from llmrpc.kernels.fake_kernels import missing_fake_kernels, register_fake_kernels

logger = logging.getLogger(__name__)

CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
# Token counts of the warm-up steps: the first compiles, the others must run without a compile.
WARM_UP_NUM_TOKENS = (2, 1, 7)


def inductor_cache_dir() -> Path:
    """``$TORCHINDUCTOR_CACHE_DIR``, set to ``cache_root()/inductor`` where it is unset or holds
    torch's own default, a folder under /tmp that may not outlive a restart (importing
    torch._dynamo sets the variable to that default)."""
    # imported here: it imports torch._dynamo (about 1.5 s), which an eager engine never needs
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    folder = os.environ.get(CACHE_ENV)
    if not folder or os.path.abspath(folder) == os.path.abspath(default_cache_dir()):
        folder = str(cache_root() / "inductor")
        os.environ[CACHE_ENV] = folder
    return Path(folder)


def compile_arguments(device: torch.device) -> dict:
    """``torch.compile``'s arguments for the decode step, with what this torch has: the guard
    filter since 2.8 (unguarded on 2.6-2.7), ``isolate_recompiles`` only where ``torch.compile``
    takes it (it is newer than 2.11, the GPU machine's torch; without it another compiled
    model in the process may find these graphs, which the engine never does)."""
    options: dict = {}
    skip_guards = getattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe", None)
    if skip_guards is not None:
        options["guard_filter_fn"] = skip_guards
    if device.type == "cpu":
        options["cpp_wrapper"] = True
    arguments: dict = {"fullgraph": True, "options": options}  # a graph break is a failure
    if "isolate_recompiles" in inspect.signature(torch.compile).parameters:
        arguments["isolate_recompiles"] = True
    return arguments


def max_compiled_rows(model: nn.Module) -> int | None:
    """The most rows a compiled step may take (None: any): a quantized layer picks its kernel by
    the number of rows, and the graph holds the packed kernel's branch only; it holds the C++
    decode attention kernel, which steps of more rows than ``compiled_decode_rows`` do without
    where torch's path was measured faster for them (``kernel_ops/attention_tuning.py``)."""
    limits = [m.dense_above for m in model.modules() if isinstance(m, QuantizedLinear)]
    limits.append(attention.compiled_decode_rows())
    return min(filter(lambda limit: limit is not None, limits), default=None)


def why_not_compiled(model: nn.Module, backend: str) -> str | None:
    """Why ``model`` is not compiled here on ``backend`` (``--attention-backend``), or None."""
    if isinstance(model, TransformersForCausalLM):
        return "the Transformers implementation (--model-impl transformers) is not compiled"
    if not getattr(model, "uses_kv_cache", True):
        return "an encoder's steps are not decodes"
    # The Triton kernels' fakes come with them (kernel_ops/triton_ops.py); the C++ kernels' are
    # needed wherever they are loaded (on the CPU, where they pack the linear layers too).
    if cpu_ops.loaded() and not register_fake_kernels():
        return f"kernels {', '.join(missing_fake_kernels())} are not built"
    if backend != "triton" and not cpu_ops.loaded():
        return "the C++ kernels are not loaded"
    rows = attention.compiled_decode_rows()
    if rows is not None and rows < max(WARM_UP_NUM_TOKENS):
        return (
            f"decode attention was measured faster on torch's path than in the C++ kernel, "
            f"which the compiled step holds, from {rows + 1} row{'s' if rows else ''}"
        )
    return None


class CompiledDecode:
    """``model.forward`` compiled for decodes-only steps; ``__call__`` answers None where the
    step must run eager (the compile failed)."""

    def __init__(self, model: nn.Module, backend: str) -> None:
        self.failure: str | None = None
        self.max_rows = max_compiled_rows(model)
        self.backend = backend
        self.device = model_device(model)
        self._warm = False
        self.cache_dir = inductor_cache_dir()  # before torch sets its own default
        self._forward = None
        try:
            self._forward = torch.compile(model.forward, **compile_arguments(self.device))
        except Exception as error:  # noqa: BLE001 - a compile that cannot be built: eager
            self._fail(error)

    def __call__(self, input_ids, positions, kv_caches, metadata: AttentionMetadata):
        """The compiled forward's hidden states, or None: run this step eager."""
        if self.failure is not None or self._forward is None:
            return None
        if self.max_rows is not None and input_ids.shape[0] > self.max_rows:
            return None  # quantized layers dequantize for so many rows: eager
        _mark_unbacked(input_ids, positions, metadata)
        # Warm, nothing compiles again. Compiling, no size is made dynamic by what another
        # model's compile of the same code saw (dynamo keeps that per code object, across
        # torch.compile calls): that made inductor's C++ wrapper check sizes it never declared
        # (a CppCompileError, seen compiling a MoE model after a dense one in one process).
        if self._warm:
            context = torch.compiler.set_stance("fail_on_recompile")
        else:
            context = torch._dynamo.config.patch(automatic_dynamic_shapes=False)
        try:
            with context:
                return self._forward(input_ids, positions, kv_caches, metadata)
        except Exception as error:  # noqa: BLE001 - any failure: eager from now on
            self._fail(error)
            return None

    @torch.inference_mode()
    def warm_up(self, kv_caches, block_size: int) -> bool:
        """Compile now, with decode steps of ``WARM_UP_NUM_TOKENS`` tokens that write into the
        first KV cache slots (call it while no request holds a block). False if it failed."""
        logger.info(
            "compiling the decode step (torch.compile: about a minute the first time on a "
            "machine, seconds from the cache in %s after)",
            self.cache_dir,
        )
        started = time.monotonic()
        if self.device.type != "cpu":  # any number of blocks: one cached compile for every size
            for cache in kv_caches:
                for tensor in cache:
                    torch._dynamo.mark_dynamic(tensor, 0)
        # On the CPU each cache's size stays static: a dynamic one is one more int argument,
        # which dynamo reads and the C++ wrapper makes into a tensor on every call (60 for 30
        # layers: 4-6% of a 1-stream step of the packaged model in -q gguf, see
        # docs/performance.md). --kv-cache-memory sets the size there, so a start with the same
        # flags finds its compile in the cache.
        num_slots = kv_caches[0][0].shape[0] * block_size
        for num_tokens in WARM_UP_NUM_TOKENS:
            input_ids, positions, metadata = _warm_up_input(
                num_tokens, block_size, num_slots, self.device, self.backend
            )
            if self(input_ids, positions, kv_caches, metadata) is None:
                return False
            self._warm = True
        logger.info("decode step compiled in %.1f s", time.monotonic() - started)
        return True

    def _fail(self, error: Exception) -> None:
        while getattr(error, "inner_exception", None) is not None:  # the compiler's own error
            error = error.inner_exception  # torch wraps it in BackendCompilerFailed
        first_line = (str(error).strip().splitlines() or [""])[0][:300]
        self.failure = f"{type(error).__name__}: {first_line}"
        logger.warning(
            "the compiled decode step failed, decode steps run eager from now on (unless the "
            "device faulted: CUDA's error is sticky, every later step fails): %s",
            self.failure,
        )


def _mark_unbacked(input_ids, positions, metadata: AttentionMetadata) -> None:
    """Sizes that change from step to step: no graph specializes on them (batch 1 included)."""
    mark = torch._dynamo.decorators.mark_unbacked
    for tensor in (input_ids, positions, metadata.slot_mapping, metadata.decode_seq_lens):
        mark(tensor, 0)
    mark(metadata.decode_block_tables, 0)
    mark(metadata.decode_block_tables, 1)


def _warm_up_input(
    num_tokens: int, block_size: int, num_slots: int, device: torch.device, backend: str
):
    """A decode step of ``num_tokens`` requests: ``(input_ids, positions, metadata)``; request
    ``i`` has ``i + 1`` tokens of context and writes slot ``i``."""
    positions = torch.arange(num_tokens, device=device)
    width = num_tokens // block_size + 1
    num_blocks = num_slots // block_size
    metadata = AttentionMetadata(
        slot_mapping=positions % num_slots,
        decode_indices=positions,
        decode_block_tables=(torch.arange(width, device=device) % num_blocks).repeat(num_tokens, 1),
        decode_seq_lens=positions + 1,
        prefills=[],
        decodes_only=True,
        backend=backend,
    )
    return torch.zeros(num_tokens, dtype=torch.long, device=device), positions, metadata
