"""What Triton's JIT would compile for the kernel launches of a block of code, found while the
kernels run in the interpreter: each launch's compile key as a compiled kernel computes it for
an NVIDIA GPU (sm_90), from the kernel's constexprs, its arguments' types and what it
specialises on (integers equal to 1 or divisible by 16, pointers' alignment) and the launch
options. A launch whose key no earlier launch had is a compile; on a GPU, one at a request is a
request that waits for the compiler."""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator

import pytest


@contextlib.contextmanager
def recorded_compile_keys() -> Iterator[dict[str, set[str]]]:
    """Kernel name -> the compile keys of its launches inside the block (which still run)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime import interpreter, jit

    backend = make_backend(GPUTarget("cuda", 90, 32))
    keys: dict[str, set[str]] = defaultdict(set)
    binders = {}
    interpreted_run = interpreter.InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        binder = binders.get(self.fn)
        if binder is None:  # the binder of the kernel as triton.jit compiles it, options and all
            compiled = jit.JITFunction(self.fn, **self.kwargs)
            binder = jit.create_function_from_signature(
                compiled.signature, compiled.params, backend
            )
            binders[self.fn] = binder
        _, specialization, options = binder(*args, **kwargs)
        keys[self.fn.__name__].add(repr((specialization, sorted(options.items()))))
        return interpreted_run(self, *args, grid=grid, warmup=warmup, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(interpreter.InterpretedFunction, "run", run)
        yield keys
