"""LoRA serving's plain-data side: its configuration, the adapters named at start-up, a request's
reference to an adapter, the errors the frontend maps to statuses, and the scheduler's rule for
adapters per step. No torch here: the gRPC server's process imports this module.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from llmrpc.engine.request import InvalidRequestError

LORA_DTYPES = ("auto", "float16", "bfloat16", "float32")
MAX_LORA_NAME_CHARS = 256  # an adapter's name, as a request's ``lora`` or OpenAI ``model``
MAX_LORA_PATH_CHARS = 4096
# vLLM's --max-lora-rank choices; the kernels mask any rank, so any of these serves
SUPPORTED_MAX_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


LORA_OFF = "LoRA is off; start the server with --enable-lora"


class LoRAAdapterNotFoundError(LookupError):
    """No adapter of that name is loaded (never was, or was unloaded)."""


class LoRAAdapterExistsError(ValueError):
    """An adapter of that name is loaded already."""


@dataclass(frozen=True)
class LoRAModulePath:
    """One ``--lora-modules`` item: ``name=path`` or ``{"name", "path", "base_model_name"}``."""

    name: str
    path: str
    base_model_name: str | None = None

    def __str__(self) -> str:  # as the flag takes it (the effective configuration shows it)
        if self.base_model_name is None:
            return f"{self.name}={self.path}"
        return json.dumps(
            {"name": self.name, "path": self.path, "base_model_name": self.base_model_name}
        )


def parse_lora_module(text: str) -> LoRAModulePath:
    """One ``--lora-modules`` item; ``ValueError`` naming the flag when malformed."""
    text = text.strip()
    if text.startswith("{"):
        try:
            item = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"--lora-modules: {text!r} is not valid JSON ({error})") from None
        unknown = set(item) - {"name", "path", "base_model_name"} if isinstance(item, dict) else ()
        if not isinstance(item, dict) or unknown or not {"name", "path"} <= set(item):
            raise ValueError(
                f'--lora-modules: {text!r} must be {{"name": ..., "path": ...}} with an optional '
                '"base_model_name" and no other key'
            )
        return LoRAModulePath(item["name"], item["path"], item.get("base_model_name"))
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules: {text!r} must be name=path or a JSON object")
    return LoRAModulePath(name, path)


@dataclass(frozen=True)
class LoRAConfig:
    """``--enable-lora`` and its settings (vLLM's names and defaults)."""

    enabled: bool = False  # --enable-lora; off, the other fields are not used
    max_loras: int = 1  # adapters one step may mix (slots of stacked weights per layer)
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # adapters kept loaded in host memory; None: max_loras
    lora_dtype: str = "auto"  # auto: the model's dtype
    enable_lora_bias: bool = False  # adapters may carry a bias on lora_B
    # loaded at start-up; --lora-modules' strings are parsed here
    lora_modules: tuple[LoRAModulePath, ...] = ()

    def __post_init__(self) -> None:
        modules = tuple(
            parse_lora_module(m) if isinstance(m, str) else m for m in self.lora_modules or ()
        )
        object.__setattr__(self, "lora_modules", modules)
        if modules and not self.enabled:
            raise ValueError("--lora-modules needs --enable-lora")
        if self.max_loras < 1:
            raise ValueError(f"--max-loras must be at least 1, got {self.max_loras}")
        if self.max_lora_rank not in SUPPORTED_MAX_RANKS:
            raise ValueError(
                f"--max-lora-rank must be one of {', '.join(map(str, SUPPORTED_MAX_RANKS))}, "
                f"got {self.max_lora_rank}"
            )
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"--max-cpu-loras ({self.max_cpu_loras}) must be at least --max-loras "
                f"({self.max_loras})"
            )
        if self.lora_dtype not in LORA_DTYPES:
            raise ValueError(
                f"--lora-dtype must be one of {', '.join(LORA_DTYPES)}, got {self.lora_dtype!r}"
            )
        names = [module.name for module in self.lora_modules]
        if len(set(names)) != len(names):
            raise ValueError(f"--lora-modules: an adapter name is given twice ({names})")

    @property
    def cpu_capacity(self) -> int:
        return self.max_cpu_loras or self.max_loras


@dataclass(frozen=True)
class LoRARef:
    """The adapter a request uses: ``lora_id`` is unique per load, so an adapter unloaded and
    loaded again under the same name is a different adapter (another slot, other cache keys)."""

    name: str
    lora_id: int
    path: str


def check_adapter_name(name: str, field_name: str = "lora_name") -> None:
    if not name:
        raise InvalidRequestError(field_name, "must not be empty")
    if len(name) > MAX_LORA_NAME_CHARS:
        raise InvalidRequestError(
            field_name, f"at most {MAX_LORA_NAME_CHARS} characters, got {len(name)}"
        )


class LoRAAdmission:
    """The scheduler's rule: the running requests use at most ``max_loras`` distinct adapters,
    so every adapter of a step has a slot. A waiting request whose adapter would be one too many
    waits; base-model requests and requests of adapters already running pass it."""

    def __init__(self, max_loras: int, running) -> None:
        self.max_loras = max_loras
        self.lora_ids = {r.lora.lora_id for r in running if r.lora is not None}

    def admits(self, request) -> bool:
        lora = request.lora
        return lora is None or lora.lora_id in self.lora_ids or len(self.lora_ids) < self.max_loras

    def admit(self, request) -> None:
        if request.lora is not None:
            self.lora_ids.add(request.lora.lora_id)
