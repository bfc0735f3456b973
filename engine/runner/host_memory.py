"""Large host buffers the engine writes as it goes (its gathered weights, the KV cache): zero
pages from the kernel, on 2 MiB pages where Linux gives them, and a KV cache's pages faulted in
ahead of use, off the step's path (``PopulateAhead``).

Each buffer is an anonymous mapping of its own: the kernel maps zero pages that become memory only
when first written, so a KV cache of gigabytes costs nothing at start-up, and the process's
resident memory grows with the blocks in use (and the margin ``PopulateAhead`` keeps). Advised
``madvise(MADV_HUGEPAGE)`` (honoured where ``/sys/kernel/mm/transparent_hugepage/enabled`` is
``always`` or ``madvise``), a first write faults in 2 MiB at once instead of 4 KiB.

Some machines charge far more for a first touch than others. On a 2-core VM (Intel Xeon, `lscpu`
"Intel(R) Xeon(R) Processor") fresh memory took 100-200 MB/s to fault in, and 4 KiB faults cost
more again: a prefill step writing 62 new blocks into each of the 60 cache tensors of the packaged
model took 410 ms in the server on 4 KiB pages, 230-280 ms on huge pages or over blocks written
before; and a step whose blocks crossed into new huge pages in all 60 tensors at once took 1.2-1.7
s (docs/performance.md). ``PopulateAhead`` faults the cache's pages in a margin ahead of the blocks
in use, with ``madvise(MADV_POPULATE_WRITE)`` on a thread that runs only on otherwise idle CPU
time: it maps each page writable as a write would and changes no byte, so it cannot race a step
writing the same block. At the usual priority the thread took CPU from the steps it ran beside: in
the same server, 32 streams, TTFT p50 437-469 ms against 375-401 ms idle-only.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import math
import mmap
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # linux/mman.h
_MADV_POPULATE_WRITE = 23  # Linux 5.14 and later
_PAGE = os.sysconf("SC_PAGE_SIZE")
_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_available() -> bool:
    """Whether ``madvise(MADV_HUGEPAGE)`` gets huge pages here (the mode is ``always`` or
    ``madvise``, not ``never``; the bracketed word of the file is the mode)."""
    try:
        mode = _THP_MODE.read_text()
    except OSError:
        return False
    return "[never]" not in mode and _libc() is not None


@functools.cache
def _libc():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name, use_errno=True) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "madvise") else None


def huge_page_buffer(num_bytes: int) -> tuple[torch.Tensor, bool]:
    """A zero-filled, untouched ``uint8`` buffer of ``num_bytes`` starting on a 2 MiB boundary,
    advised onto huge pages where they are available; and whether it was. The pages are faulted
    in by the first write, so write the buffer only after this returns."""
    # A mapping of its own: malloc may carve even a large block from memory it already holds,
    # written and on 4 KiB pages (calloc then writes the zeros itself).
    region = np.frombuffer(mmap.mmap(-1, num_bytes + HUGE_PAGE), dtype=np.uint8)
    start = -region.ctypes.data % HUGE_PAGE
    # A storage of its own from the aligned start: torch.compile copies a graph input at an
    # offset into its storage, on every call (a compiled decode step took 350 ms, not 19).
    buffer = torch.from_numpy(region[start : start + num_bytes])
    advised = False
    if huge_pages_available() and num_bytes:
        length = -(-num_bytes // HUGE_PAGE) * HUGE_PAGE
        result = _libc().madvise(
            ctypes.c_void_p(buffer.data_ptr()), ctypes.c_size_t(length), _MADV_HUGEPAGE
        )
        advised = result == 0
        if not advised:
            logger.debug("madvise(MADV_HUGEPAGE) failed: errno %d", ctypes.get_errno())
    return buffer, advised


def host_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled host tensor in a buffer of its own (``huge_page_buffer``)."""
    buffer, _ = huge_page_buffer(math.prod(shape) * dtype.itemsize)
    return buffer.view(dtype).view(shape)


def populate(address: int, num_bytes: int) -> bool:
    """Fault in the pages of ``[address, address + num_bytes)`` as a write would, changing no
    byte (``MADV_POPULATE_WRITE``); False where the kernel cannot (older than 5.14)."""
    libc = _libc()
    start = address - address % _PAGE
    length = address + num_bytes - start
    if libc is None or length <= 0:
        return False
    return libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), _MADV_POPULATE_WRITE) == 0


class PopulateAhead:
    """Faults in the leading blocks of block-major host tensors (each ``[num_blocks, ...]``) up
    to ``wanted()`` blocks, a huge page's worth of blocks at a time, on a thread scheduled
    ``SCHED_IDLE`` (it runs only when no other thread of the machine wants the CPU). The thread
    polls ``wanted()`` every ``poll_s``. It holds the tensors weakly and ends on ``stop()``, when
    every block is populated, when a tensor or ``wanted``'s owner is gone (``wanted()`` gives
    None), or where the kernel cannot populate."""

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        wanted: Callable[[], int | None],
        poll_s: float = 0.05,
    ) -> None:
        tensors = [tensor for tensor in tensors if tensor.numel()]
        self._tensors = [(weakref.ref(t), t.stride(0) * t.element_size()) for t in tensors]
        self._num_blocks = min((t.shape[0] for t in tensors), default=0)
        self._wanted, self._poll_s = wanted, poll_s
        self.populated = 0  # leading blocks faulted in, in every tensor
        self._stopped = threading.Event()
        block_bytes = max((stride for _, stride in self._tensors), default=1)
        self._step = max(1, HUGE_PAGE // block_bytes)
        self._thread = threading.Thread(target=self._run, name="llmrpc-kv-populate", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the thread; returns once it no longer touches the tensors."""
        self._stopped.set()
        self._thread.join()

    def _run(self) -> None:
        try:
            os.sched_setscheduler(threading.get_native_id(), os.SCHED_IDLE, os.sched_param(0))
        except OSError as error:  # at the usual priority, then
            logger.debug("KV cache populating thread not SCHED_IDLE: %s", error)
        while self.populated < self._num_blocks and not self._stopped.is_set():
            wanted = self._wanted()
            if wanted is None:
                return
            if min(wanted, self._num_blocks) <= self.populated:
                self._stopped.wait(self._poll_s)
                continue
            end = min(wanted, self._num_blocks, self.populated + self._step)
            for ref, stride in self._tensors:
                tensor = ref()  # held while its pages are populated: not freed meanwhile
                if tensor is None or self._stopped.is_set():
                    return
                first = tensor.data_ptr() + self.populated * stride
                if not populate(first, (end - self.populated) * stride):
                    logger.debug("KV cache pages not populated (errno %d)", ctypes.get_errno())
                    return
                del tensor
            self.populated = end
