"""LoRA adapters in the engine core: the registry (name -> path, id), an LRU of adapters loaded in
host memory (``--max-cpu-loras``), and the ``--max-loras`` slots of stacked weights per layer.

A request holds a ``LoRARef`` (name, id, path). Unloading an adapter removes its name, so new
requests for it are NOT_FOUND; requests already holding its ref finish on it: its slot keeps the
weights, and a request preempted meanwhile gets them back from host memory or, once evicted
there, from its folder. Slots are filled when an adapter's first request is scheduled; the least
recently used slot no running request needs is replaced.
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict

import torch

from llmrpc.engine.config import EngineConfig
from llmrpc.engine.loading import loader
from llmrpc.engine.lora.layers import LoRAModel
from llmrpc.engine.lora.peft import LoRAAdapter, load_adapter
from llmrpc.engine.lora.types import (
    MAX_LORA_PATH_CHARS,
    LoRAAdapterExistsError,
    LoRAAdapterNotFoundError,
    LoRAConfig,
    LoRARef,
    check_adapter_name,
)
from llmrpc.engine.request import InvalidRequestError, Request
from llmrpc.engine.sched.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def resolve_lora_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """``--lora-dtype``: auto is the model's; another one is refused (the kernels add the
    adapters' products into the layers' outputs in the model's dtype)."""
    dtype = model_dtype if name == "auto" else _DTYPES[name]
    if dtype != model_dtype:
        raise ValueError(
            f"--lora-dtype {name} differs from the model's dtype "
            f"({str(model_dtype).removeprefix('torch.')}); use auto"
        )
    return dtype


def check_lora_options(config: EngineConfig) -> None:
    """Refuse, at start-up, what does not work with ``--enable-lora`` here."""
    level = config.compilation.level
    if level:
        raise ValueError(
            f"-O / --compilation-config level {level} is refused with --enable-lora: the "
            "compiled decode step has no LoRA layers; use level 0 (or --enforce-eager)"
        )
    if config.model.batch_invariant:
        raise ValueError(
            "--batch-invariant is refused with --enable-lora: the adapters' matmuls are not "
            "batch-invariant kernels (their rows are grouped by adapter)"
        )


def build_lora_manager(config: EngineConfig, model, model_dtype: torch.dtype, backend: str):
    """The engine's ``LoRAManager`` under ``--enable-lora``, else None. ``backend``: the
    resolved attention backend; "triton" takes the Triton LoRA kernels in every step."""
    if not config.lora.enabled:
        return None
    check_lora_options(config)
    names = config.model.served_model_name or (loader.default_served_name(config.model.model),)
    return LoRAManager(config.lora, model, model_dtype, names[0], dense=backend == "torch")


def resolve_adapter(manager: LoRAManager | None, name: str) -> LoRARef:
    """The adapter a request names: NOT_FOUND (``LoRAAdapterNotFoundError``) when none of that
    name is loaded, LoRA being off included (as for any other unknown model name)."""
    check_adapter_name(name, "lora")
    if manager is None:
        raise LoRAAdapterNotFoundError(
            f"no LoRA adapter named {name!r}: this server runs without --enable-lora"
        )
    return manager.resolve(name)


class LoRAManager:
    def __init__(
        self,
        config: LoRAConfig,
        model,
        model_dtype: torch.dtype,
        base_model_name: str,
        dense: bool = True,  # small CPU steps may take the dense path (engine/lora/layers.py)
    ) -> None:
        self.config = config
        self.dense = dense
        self.dtype = resolve_lora_dtype(config.lora_dtype, model_dtype)
        self.base_model_name = base_model_name
        self._ids = itertools.count(1)
        self.registry: dict[str, tuple[LoRARef, str]] = {}  # name -> (ref, base model name)
        self._host: OrderedDict[int, LoRAAdapter] = OrderedDict()  # lora_id -> adapter, LRU
        self.attach(model)
        for module in config.lora_modules:
            self.add(module.name, module.path, module.base_model_name)

    def attach(self, model) -> None:
        """Wrap ``model``'s projections (at start-up, and when a wake-up reloads the model)."""
        config = self.config
        self.lora_model = LoRAModel(
            model,
            config.max_loras,
            config.max_lora_rank,
            config.enable_lora_bias,
            self.dtype,
            self.dense,
        )
        self.context = self.lora_model.context
        self._slots: list[int | None] = [None] * config.max_loras  # lora_id in each slot
        self._slot_use: list[int] = [0] * config.max_loras  # step of last use, for LRU
        self._step = 0

    # --- the registry ---------------------------------------------------------------------

    def add(self, name: str, path: str, base_model_name: str | None = None) -> dict:
        """Load and check the adapter at ``path`` under ``name``."""
        check_adapter_name(name)
        if not path:
            raise InvalidRequestError("lora_path", "must not be empty")
        if len(path) > MAX_LORA_PATH_CHARS:
            raise InvalidRequestError("lora_path", f"at most {MAX_LORA_PATH_CHARS} characters")
        if name in self.registry:
            raise LoRAAdapterExistsError(f"an adapter named {name!r} is loaded already")
        adapter = self._read(path)
        ref = LoRARef(name, next(self._ids), path)
        self.registry[name] = (ref, base_model_name or self.base_model_name)
        self._keep(ref.lora_id, adapter)
        logger.info("LoRA adapter %r loaded from %s (rank %d)", name, path, adapter.rank)
        return self._entry(name)

    def remove(self, name: str) -> None:
        """Unload ``name``: new requests cannot use it; running ones finish on it."""
        if name not in self.registry:
            raise LoRAAdapterNotFoundError(f"no LoRA adapter named {name!r} is loaded")
        ref, _ = self.registry.pop(name)
        self._host.pop(ref.lora_id, None)
        logger.info("LoRA adapter %r unloaded", name)

    def list(self) -> list[dict]:
        return [self._entry(name) for name in self.registry]

    def _entry(self, name: str) -> dict:
        ref, base = self.registry[name]
        return {"name": name, "path": ref.path, "base_model_name": base, "id": ref.lora_id}

    def resolve(self, name: str) -> LoRARef:
        """The adapter a request names; ``LoRAAdapterNotFoundError`` if none is loaded."""
        entry = self.registry.get(name)
        if entry is None:
            raise LoRAAdapterNotFoundError(f"no LoRA adapter named {name!r} is loaded")
        return entry[0]

    def _read(self, path: str) -> LoRAAdapter:
        shapes, config = self.lora_model.shapes, self.config
        num_layers = self.lora_model.num_layers
        return load_adapter(
            path, config.max_lora_rank, config.enable_lora_bias, shapes, num_layers, self.dtype
        )

    def _keep(self, lora_id: int, adapter: LoRAAdapter) -> None:
        self._host[lora_id] = adapter
        self._host.move_to_end(lora_id)
        while len(self._host) > self.config.cpu_capacity:
            self._host.popitem(last=False)  # read again from its folder when next needed

    # --- slots ----------------------------------------------------------------------------

    def prepare(self, output: SchedulerOutput, running) -> dict[Request, str]:
        """Give every adapter of the step a slot. Requests whose adapter could not be read back
        from its folder leave the step; they are returned (with why) for the caller to fail."""
        failed = self._fill_slots(output.scheduled, running)
        if failed:
            output.scheduled = [(r, n) for r, n in output.scheduled if r not in failed]
        return failed

    def _fill_slots(self, scheduled: list[tuple[Request, int]], running) -> dict[Request, str]:
        self._step += 1
        needed = {r.lora.lora_id: r.lora for r, _ in scheduled if r.lora is not None}
        busy = {r.lora.lora_id for r in running if r.lora is not None} | needed.keys()
        failed: dict[Request, str] = {}
        for lora_id, ref in needed.items():
            if lora_id in self._slots:
                self._slot_use[self._slots.index(lora_id)] = self._step
                continue
            error = self._fill_slot(ref, busy, needed.keys())
            if error is not None:
                failed.update({r: error for r, _ in scheduled if r.lora is ref})
        return failed

    def _fill_slot(self, ref: LoRARef, busy, needed) -> str | None:
        adapter = self._host.get(ref.lora_id)
        if adapter is None:
            try:
                adapter = self._read(ref.path)
            except (InvalidRequestError, OSError) as error:
                return f"LoRA adapter {ref.name!r} could not be read again: {error}"
            self._keep(ref.lora_id, adapter)
        slot = self._free_slot(busy, needed)
        self.lora_model.set_slot(slot, adapter)
        self._slots[slot], self._slot_use[slot] = ref.lora_id, self._step
        logger.debug("LoRA adapter %r in slot %d", ref.name, slot)
        return None

    def _free_slot(self, busy, needed) -> int:
        """An empty slot, else the least recently used one no running request needs (the
        scheduler keeps the running adapters within ``--max-loras``), else one this step does
        not need."""
        for exclude in (busy, needed):
            free = [s for s, lora_id in enumerate(self._slots) if lora_id not in exclude]
            if free:
                return min(free, key=lambda s: (self._slots[s] is not None, self._slot_use[s]))
        raise RuntimeError("more adapters in one step than --max-loras slots")

    def slot_of(self, request: Request) -> int:
        """The slot of ``request``'s adapter (after ``prepare``); -1 for the base model."""
        return -1 if request.lora is None else self._slots.index(request.lora.lora_id)
