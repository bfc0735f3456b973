"""The model's CPU weights gathered into one buffer, in the order a step reads them, on huge pages
where Linux gives them.

A decode step at a small batch reads every weight once, so its speed is the speed of that read.
Loaded one tensor at a time, the weights lie scattered over 4 KiB pages: each layer's read
starts cold, and every 4 KiB costs a page-table walk that the hardware prefetcher does not
cross. In one buffer in module order (a layer's projections, then the next layer's) the read is
one stream, and on 2 MiB pages (``madvise(MADV_HUGEPAGE)``, which Linux honours where
``/sys/kernel/mm/transparent_hugepage/enabled`` is ``always`` or ``madvise``) it walks 512 times
fewer pages. Measured on an AMD EPYC (family 26, AVX512-BF16, no AMX; 2 cores): the 121
bf16 linear calls of a SmolLM2 decode step at one row took 9.35 ms scattered, 8.48 ms gathered on
4 KiB pages, 8.08 ms gathered on huge pages (one thread, medians of 30 steps, docs/performance.md).

Every tensor a module holds (parameters, buffers, and packed weights kept as attributes) moves
once, with ``Tensor.set_``, so every reference to it (a tied head and its embedding) follows.
oneDNN's packed weights are opaque and stay where oneDNN put them; so does a tensor that shares
its storage with a tensor of another shape (a view), which could not follow.
"""

from __future__ import annotations

import torch
from torch import nn

from llmrpc.engine.memory import release_free_memory
from llmrpc.engine.runner.host_memory import huge_page_buffer

_ALIGN = 64  # each tensor starts on a cache line
# The old copies are freed as their tensors move; returning their pages this often bounds the
# peak to the weights plus this much (malloc keeps freed heap pages until trimmed).
_TRIM_EVERY_BYTES = 256 << 20


def _movable(tensor: torch.Tensor) -> bool:
    """A CPU tensor that is all of its storage, laid out densely: it can move whole."""
    return (
        tensor.device.type == "cpu"
        and tensor.layout == torch.strided
        and not tensor.is_mkldnn
        and tensor.is_contiguous()
        and tensor.storage_offset() == 0
        and tensor.untyped_storage().nbytes() == tensor.nbytes
        and tensor.nbytes > 0
    )


def _weights_in_order(model: nn.Module) -> list[torch.Tensor]:
    """Every movable tensor the model's modules hold, each storage once, in module order."""
    seen: set[int] = set()
    tensors = []
    for module in model.modules():
        held = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        held += [value for value in vars(module).values() if isinstance(value, torch.Tensor)]
        for tensor in held:
            pointer = tensor.untyped_storage().data_ptr() if not tensor.is_mkldnn else 0
            if pointer in seen or not _movable(tensor):
                continue
            seen.add(pointer)
            tensors.append(tensor)
    return tensors


def gather_weights(model: nn.Module) -> tuple[int, bool]:
    """Move the model's CPU weights into one huge-page buffer in module order (see the module
    docstring); returns the bytes moved and whether the buffer is on huge pages."""
    tensors = _weights_in_order(model)
    offsets, total = [], 0
    for tensor in tensors:
        total = -(-total // _ALIGN) * _ALIGN
        offsets.append(total)
        total += tensor.nbytes
    if not tensors:
        return 0, False
    buffer, advised = huge_page_buffer(total)
    moved_since_trim = 0
    with torch.no_grad():
        for tensor, offset in zip(tensors, offsets, strict=True):
            place = buffer[offset : offset + tensor.nbytes].view(tensor.dtype).view(tensor.shape)
            place.copy_(tensor)
            moved_since_trim += tensor.nbytes
            tensor.set_(place)  # every holder of this tensor now reads the buffer
            if moved_since_trim >= _TRIM_EVERY_BYTES:
                release_free_memory()
                moved_since_trim = 0
    release_free_memory()
    return total, advised
