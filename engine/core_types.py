"""The engine core's plain types: what its clients (the gRPC frontend, the engine process's
channel) read and raise without loading the core, its model or torch."""

from __future__ import annotations

from dataclasses import dataclass, field

from llmrpc.common.spec_decode import SpecDecodeCounts
from llmrpc.engine.config import StructuredOutputConfig


@dataclass(frozen=True)
class ModelInfo:
    served_model_names: tuple[str, ...]
    max_model_len: int
    vocab_size: int
    eos_token_ids: frozenset[int]
    bos_token_id: int | None
    has_chat_template: bool
    dtype: str
    block_size: int
    num_kv_blocks: int
    sampling_defaults: dict  # SamplingParams field -> server default (generation config)
    model_dir: str = ""  # the folder the weights were loaded from (a .gguf file's converted one)
    # how requests' structured output is checked and built (--guided-decoding-*)
    structured_output: StructuredOutputConfig = field(default_factory=StructuredOutputConfig)
    runner: str = "generate"  # or "pooling": embeddings only (engine/pooling/params.py)
    embedding_size: int = 0  # the model's hidden size: an embedding's length
    kernels: tuple[KernelChoice, ...] = ()  # the CPU's measured linear kernels; () on a GPU


@dataclass(frozen=True)
class KernelChoice:
    """The kernel the engine runs, chosen by timing the candidates on this machine, for one shape
    of linear layer and one bucket of rows per call (kernel_ops/linear_tuning.py)."""

    op: str  # "linear bfloat16 576x1536" (inputs x outputs)
    num_layers: int
    rows: str  # "1", "2-8", ..., "1025+"
    kernel: str
    times_us: dict[str, float]  # each candidate timed at this bucket: microseconds per layer


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    prefix_cache_hit_rate: float  # cached prompt tokens / prompt tokens looked up, since start
    generation_throughput: float  # output tokens per second over the recent window
    prompt_throughput: float  # prompt tokens computed per second over the recent window
    is_sleeping: bool
    kv_cache_bytes: int = 0  # 0 while asleep
    device_memory_used_bytes: int = 0  # on CUDA, by every process; 0 on the CPU
    device_memory_total_bytes: int = 0
    device_utilization: float | None = None  # on CUDA where NVML reads it, in [0, 1]
    spec_decode: SpecDecodeCounts | None = None  # with --speculative-config

    @property
    def kv_cache_usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_total_blocks


class EngineStateError(RuntimeError):
    """The engine cannot do this in its present state (asleep, busy, sleep mode off)."""
