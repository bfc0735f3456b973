"""Typed engine configuration: frozen dataclasses built once from the CLI.

Each component takes only its own part. Bad values raise ``ValueError`` naming the flag.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")


@dataclass(frozen=True)
class ModelConfig:
    """What to load and how: ``--model``, ``--tokenizer``, ``--dtype``, ``--max-model-len``..."""

    model: str | None = None  # None: the packaged SmolLM2-135M-Instruct
    tokenizer: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None  # None: the model's own context length
    seed: int = 0
    load_format: str = "auto"
    served_model_name: tuple[str, ...] = ()
    enable_sleep_mode: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(
                f"--load-format must be one of {', '.join(LOAD_FORMATS)}, got {self.load_format!r}"
            )
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"--max-model-len must be positive, got {self.max_model_len}")


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: ``--block-size`` and its size in host memory (``--kv-cache-memory``)."""

    block_size: int = 16
    kv_cache_memory_gib: float = 4.0  # host memory for the KV cache when no GPU is used
    num_gpu_blocks_override: int | None = None  # exact number of blocks (tests, benchmarks)
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"--block-size must be a positive power of two, got {self.block_size}")
        if self.kv_cache_memory_gib <= 0:
            raise ValueError(f"--kv-cache-memory must be positive, got {self.kv_cache_memory_gib}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 2:
            raise ValueError(
                f"--num-gpu-blocks-override must be at least 2, got {self.num_gpu_blocks_override}"
            )


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits: ``--max-num-seqs`` and ``--max-num-batched-tokens``."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048

    def __post_init__(self) -> None:
        if self.max_num_seqs <= 0:
            raise ValueError(f"--max-num-seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens <= 0:
            raise ValueError(
                f"--max-num-batched-tokens must be positive, got {self.max_num_batched_tokens}"
            )


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
