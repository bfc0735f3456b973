"""Functions a test runs inside the engine core, wherever it lives (a thread of the test's
process, or the engine process), with ``call_in_core(engine, function, *args)``.

Each takes the ``EngineCore`` first; arguments and results are plain data. Whatever one changes
lasts until undone (``pace(core, None)``, ``remove_faults``) or until the engine stops.
"""

from __future__ import annotations

import importlib
import time
import types

_UNDO = "_test_undo"  # the core's list of (owner, attribute name, (saved value,) or ())


def pace(core, seconds_per_step: float | None) -> None:
    """Make every step take at least ``seconds_per_step`` more; None restores the pace."""
    core.__dict__.pop("step", None)  # the instance attribute of an earlier pace hides the method
    if seconds_per_step is None:
        return
    real_step = core.step

    def slow_step():
        time.sleep(seconds_per_step)
        return real_step()

    core.step = slow_step


def pause(core, seconds: float) -> None:
    """Hold the engine for ``seconds``: commands sent meanwhile are applied together after it."""
    time.sleep(seconds)


def break_steps(core, message: str) -> None:
    """Every step from now on raises ``RuntimeError(message)``: the step loop dies."""

    def broken_step():
        raise RuntimeError(message)

    core.step = broken_step


def break_forward_pass(core, message: str) -> None:
    """The model runner's forward pass raises ``RuntimeError(message)``."""

    def broken(*args, **kwargs):
        raise RuntimeError(message)

    _replace(core, core.runner, "execute", broken)


def fail_requests(core, target: str, prefix: str, kind: str = "runtime", after: int = 0) -> None:
    """``target`` raises while any of its arguments is a request whose id starts with
    ``prefix`` (past the first ``after`` such calls): ``RuntimeError("injected fault for
    <id>")``, or with ``kind`` "unicode" a ``UnicodeDecodeError`` whose reason is "injected".

    ``target`` is an attribute path from the core ("output_processor.add_token") or a module's
    function ("llmrpc.engine.sample.sampler:apply_logits_processors").
    """
    if ":" in target:
        module_name, name = target.split(":")
        owner = importlib.import_module(module_name)
    else:
        *path, name = target.split(".")
        owner = core
        for part in path:
            owner = getattr(owner, part)
    real = getattr(owner, name)
    calls = [0]

    def faulty(*args, **kwargs):
        for arg in args:
            for request in arg if isinstance(arg, list) else [arg]:
                request_id = getattr(request, "request_id", None)
                if isinstance(request_id, str) and request_id.startswith(prefix):
                    calls[0] += 1
                    if calls[0] <= after:
                        continue
                    if kind == "unicode":
                        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
                    raise RuntimeError(f"injected fault for {request_id}")
        return real(*args, **kwargs)

    _replace(core, owner, name, faulty)


def fail_prompt_logprobs(core, num_logits: int) -> None:
    """Prompt logprobs fail for a span of ``num_logits`` positions."""
    real = core.sampler.logprob_values

    def faulty(logits):
        if logits.shape[0] == num_logits:
            raise RuntimeError("injected fault for prompt logprobs")
        return real(logits)

    _replace(core, core.sampler, "logprob_values", faulty)


def remove_faults(core) -> None:
    """Undo every ``fail_*`` and ``break_forward_pass``, latest first."""
    undo = core.__dict__.get(_UNDO, [])
    while undo:
        owner, name, saved = undo.pop()
        if saved:
            setattr(owner, name, saved[0])
        else:
            delattr(owner, name)


def sleep_state(core) -> list:
    """How many KV cache tensors the core holds, and whether its weights are gone."""
    return [len(core.runner.kv_caches), core.model is None]


def the_runner(core):
    """The model runner itself: an object no message can carry."""
    return core.runner


def weights_device(core) -> str:
    return str(next(core.runner.model.parameters()).device)


def _replace(core, owner, name: str, value) -> None:
    # A module's function, or an instance attribute already there, is put back; an attribute
    # that hid a class's method is deleted.
    kept = name in vars(owner) or isinstance(owner, types.ModuleType)
    saved = (getattr(owner, name),) if kept else ()
    core.__dict__.setdefault(_UNDO, []).append((owner, name, saved))
    setattr(owner, name, value)
