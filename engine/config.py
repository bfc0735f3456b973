"""Typed engine configuration: frozen dataclasses built once from the CLI.

Each component takes only its own part. Bad values raise ``ValueError`` naming the flag.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llmrpc.engine.lora.types import LoRAConfig
from llmrpc.engine.parallel.config import ParallelConfig, check_parallel_options
from llmrpc.engine.pooling.params import check_pooling_flags
from llmrpc.engine.request import DEFAULT_MAX_JSON_WHITESPACE
from llmrpc.engine.spec_decode.config import SpeculativeConfig, check_speculative_options

DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
MODEL_IMPLS = ("auto", "vllm", "transformers")  # "vllm": our native models, as vLLM names them
# --quantization: weight-only int8 and int4 (ours), and a .gguf file's own blocks (vLLM's name)
QUANTIZATION_METHODS = ("int8", "int4", "gguf")
DEVICES = ("auto", "cuda", "cpu")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
# --attention-backend: the kernels of the attention, norm and rotary steps (kernel_ops/)
ATTENTION_BACKENDS = ("auto", "torch", "triton")
# -O / --compilation-config levels, as vLLM numbers them: 0 eager; 1-3 all compile decode steps here
COMPILATION_LEVELS = (0, 1, 2, 3)
# Eager: compiled, a decode step took 0.91x eager's time at batch 1 but 0.97x at 32 (2 cores, the
# packaged model, bf16), for a first start 45 s longer (docs/performance.md).
DEFAULT_COMPILATION_LEVEL = 0
# --max-seq-len-to-capture's default, as vLLM's: longer contexts run their decode steps eager
DEFAULT_MAX_SEQ_LEN_TO_CAPTURE = 8192


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
    max_logprobs: int = 20  # -1: no limit
    logprobs_mode: str = "raw_logprobs"
    hf_overrides: dict = field(default_factory=dict)  # set on the model's config after loading
    rope_scaling: dict = field(default_factory=dict)  # over the model's own rope parameters
    rope_theta: float | None = None
    generation_config: str = "auto"  # auto | vllm | a folder with generation_config.json
    override_generation_config: dict = field(default_factory=dict)
    skip_tokenizer_init: bool = False  # token ids in, token ids out
    model_impl: str = "auto"  # auto: native when the architecture has one, else Transformers
    quantization: str | None = None  # None: the weights in --dtype (a .gguf file dequantized)
    device: str = "auto"  # auto: CUDA where a device is visible, else the CPU
    attention_backend: str = "auto"  # auto: triton on CUDA, torch elsewhere
    batch_invariant: bool = False  # a request's tokens do not depend on the rest of the batch
    # --disable-sliding-window: a model with attention windows is capped at the window
    disable_sliding_window: bool = False
    # embeddings (engine/pooling/params.py): --runner, --convert, --task, --override-pooler-config
    runner: str = "auto"
    convert: str = "auto"
    task: str | None = None
    override_pooler_config: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        for flag, value, choices in (
            ("--device", self.device, DEVICES),
            ("--attention-backend", self.attention_backend, ATTENTION_BACKENDS),
        ):
            if value not in choices:
                raise ValueError(f"{flag} must be one of {', '.join(choices)}, got {value!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(
                f"--load-format must be one of {', '.join(LOAD_FORMATS)}, got {self.load_format!r}"
            )
        if self.model_impl not in MODEL_IMPLS:
            raise ValueError(
                f"--model-impl must be one of {', '.join(MODEL_IMPLS)}, got {self.model_impl!r}"
            )
        self._check_quantization()
        check_pooling_flags(self.runner, self.convert, self.task, self.override_pooler_config)
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"--max-model-len must be positive, got {self.max_model_len}")

    def _check_quantization(self) -> None:
        method = self.quantization
        if method is None:
            return
        if method not in QUANTIZATION_METHODS:
            raise ValueError(
                f"--quantization must be one of {', '.join(QUANTIZATION_METHODS)}, got {method!r}"
            )
        if method != "gguf":
            return
        if self.model is not None and not self.model.endswith(".gguf"):
            raise ValueError(
                f"--quantization gguf serves a .gguf file's own quantized blocks; --model "
                f"{self.model!r} is not a .gguf file (use int8 or int4 to quantize a folder)"
            )
        if self.load_format == "dummy":
            raise ValueError(
                "--quantization gguf reads the .gguf file's weights; --load-format dummy reads "
                "none (use int8 or int4 with random weights)"
            )


# --kv-events-config: the keys of vLLM's KVEventsConfig this build takes, and their defaults
KV_EVENTS_DEFAULTS = {
    "enable_kv_cache_events": False,
    "buffer_steps": 10_000,
    "max_queue_size": 100_000,
}
# the keys of its ZeroMQ publisher, which this build does not have
_KV_EVENTS_ZMQ_KEYS = ("publisher", "endpoint", "replay_endpoint", "hwm", "topic")
KV_EVENTS_OVER_GRPC = (
    "this build publishes KV events on its gRPC port only "
    "(vllm.grpc.engine.VllmEngine/SubscribeKvEvents), not over ZeroMQ"
)


def check_kv_events_config(config: dict | None, enable_prefix_caching: bool) -> None:
    """``--kv-events-config``: ``enable_kv_cache_events`` (a boolean), ``buffer_steps`` (event
    batches kept for a subscriber that resumes) and ``max_queue_size`` (batches a subscriber may
    fall behind before its stream ends with DATA_LOSS), positive integers; the ZeroMQ
    publisher's keys are refused by name. ValueError naming the flag."""
    if config is None:
        return
    for key in config:
        if key in _KV_EVENTS_ZMQ_KEYS:
            raise ValueError(f"--kv-events-config: {key!r}: {KV_EVENTS_OVER_GRPC}; leave it unset")
        if key not in KV_EVENTS_DEFAULTS:
            raise ValueError(
                f"--kv-events-config: unknown key {key!r}; this build takes "
                f"{', '.join(map(repr, KV_EVENTS_DEFAULTS))}"
            )
    enabled = config.get("enable_kv_cache_events", False)
    if type(enabled) is not bool:
        raise ValueError(
            f"--kv-events-config: enable_kv_cache_events must be true or false, got {enabled!r}"
        )
    for key in ("buffer_steps", "max_queue_size"):
        value = config.get(key, KV_EVENTS_DEFAULTS[key])
        if type(value) is not int or value <= 0:
            raise ValueError(f"--kv-events-config: {key} must be a positive integer, got {value!r}")
    if enabled and not enable_prefix_caching:
        raise ValueError(
            "--kv-events-config: enable_kv_cache_events reports the prefix cache's blocks, and "
            "--no-enable-prefix-caching turns the prefix cache off"
        )


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: ``--block-size`` and its size in host memory (``--kv-cache-memory``)."""

    block_size: int = 16
    kv_cache_memory_gib: float = 4.0  # host memory for the KV cache when no GPU is used
    gpu_memory_utilization: float = 0.9  # share of a CUDA device's memory for the engine
    cache_dtype: str = "auto"  # --kv-cache-dtype: auto (the model's dtype), or an fp8 type
    num_gpu_blocks_override: int | None = None  # exact number of blocks (tests, benchmarks)
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "builtin"
    # --kv-events-config: vLLM's KVEventsConfig as a JSON object (check_kv_events_config)
    kv_events_config: dict | None = None

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"--block-size must be a positive power of two, got {self.block_size}")
        check_kv_events_config(self.kv_events_config, self.enable_prefix_caching)
        if self.cache_dtype == "fp8_inc":
            raise ValueError(
                "--kv-cache-dtype fp8_inc is for Intel Gaudi devices; use fp8 (fp8_e4m3) or "
                "fp8_e5m2"
            )
        if self.cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got "
                f"{self.cache_dtype!r}"
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.kv_cache_memory_gib <= 0:
            raise ValueError(f"--kv-cache-memory must be positive, got {self.kv_cache_memory_gib}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 2:
            raise ValueError(
                f"--num-gpu-blocks-override must be at least 2, got {self.num_gpu_blocks_override}"
            )

    @property
    def kv_events(self) -> bool:
        """Whether the prefix cache's changes are recorded and published."""
        return bool((self.kv_events_config or {}).get("enable_kv_cache_events"))

    def kv_events_setting(self, key: str) -> int:
        """``buffer_steps`` or ``max_queue_size`` of --kv-events-config, or its default."""
        return (self.kv_events_config or {}).get(key, KV_EVENTS_DEFAULTS[key])


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching: batch limits, chunked prefill, scheduling and preemption policy."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    max_num_partial_prefills: int = 1  # prompts left part-computed by one step
    max_long_partial_prefills: int = 1  # of those, how many may be long
    long_prefill_token_threshold: int = 0  # more tokens left: "long"; also a chunk's cap
    scheduling_policy: str = "fcfs"
    preemption_mode: str | None = None  # None: recompute

    def __post_init__(self) -> None:
        for flag, value in (
            ("--max-num-partial-prefills", self.max_num_partial_prefills),
            ("--max-long-partial-prefills", self.max_long_partial_prefills),
        ):
            if value < 1:
                raise ValueError(f"{flag} must be at least 1, got {value}")
        if self.max_long_partial_prefills > self.max_num_partial_prefills:
            raise ValueError(
                "--max-long-partial-prefills must not exceed --max-num-partial-prefills"
            )
        if self.long_prefill_token_threshold < 0:
            raise ValueError("--long-prefill-token-threshold must be >= 0")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(
                f"--scheduling-policy must be fcfs or priority, got {self.scheduling_policy!r}"
            )
        if self.preemption_mode == "swap":
            raise ValueError(
                "--preemption-mode swap is refused: a preempted request's KV cache is "
                "recomputed, never swapped to host memory (on the CPU it lives there already); "
                "use recompute"
            )
        if self.preemption_mode not in (None, "recompute"):
            raise ValueError(f"--preemption-mode must be recompute, got {self.preemption_mode!r}")
        if self.max_num_seqs <= 0:
            raise ValueError(f"--max-num-seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens <= 0:
            raise ValueError(
                f"--max-num-batched-tokens must be positive, got {self.max_num_batched_tokens}"
            )


@dataclass(frozen=True)
class CompilationConfig:
    """``-O`` / ``--compilation-config``, ``--enforce-eager``, ``--cuda-graph-sizes`` and
    ``--max-seq-len-to-capture``: whether decode steps run a ``torch.compile`` of the model's
    forward (``engine/runner/compilation.py``), CUDA graphs of it (``engine/runner/cuda_graphs.py``,
    a CUDA device) or eager PyTorch.

    ``config`` is vLLM's JSON object: ``{"level": N}`` (``-ON``), or ``{"mode": N}`` as newer
    vLLM names it; any other key is refused, so nothing given is silently ignored.
    """

    config: dict = field(default_factory=dict)  # {} : DEFAULT_COMPILATION_LEVEL
    enforce_eager: bool = False  # level 0 and no CUDA graphs, whatever the rest says
    # (): vLLM's default, [min(2 * --max-num-seqs, 512)]; one value N: 1, 2, 4 and the
    # multiples of 8 up to N; several: those sizes (cuda_graphs.capture_sizes)
    cuda_graph_sizes: tuple[int, ...] = ()
    max_seq_len_to_capture: int | None = None  # None: DEFAULT_MAX_SEQ_LEN_TO_CAPTURE

    def __post_init__(self) -> None:
        self._check_cuda_graph_flags()
        unknown = sorted(set(self.config) - {"level", "mode"})
        if unknown:
            raise ValueError(
                f"--compilation-config: unknown key{'s' if len(unknown) > 1 else ''} "
                f'{", ".join(map(repr, unknown))}; this build takes only "level" (or "mode", '
                f"vLLM's newer name for it), one of {', '.join(map(str, COMPILATION_LEVELS))}"
            )
        levels = {self.config[key] for key in ("level", "mode") if key in self.config}
        if len(levels) > 1:
            raise ValueError(
                f'--compilation-config: "level" and "mode" name the same setting and '
                f"disagree ({self.config['level']!r} and {self.config['mode']!r})"
            )
        for level in levels:
            if type(level) is not int or level not in COMPILATION_LEVELS:
                raise ValueError(
                    f"--compilation-config: level must be one of "
                    f"{', '.join(map(str, COMPILATION_LEVELS))}, got {level!r}"
                )

    def _check_cuda_graph_flags(self) -> None:
        for size in self.cuda_graph_sizes:
            if type(size) is not int or size <= 0:
                raise ValueError(f"--cuda-graph-sizes: each size must be positive, got {size!r}")
        length = self.max_seq_len_to_capture
        if length is not None and (type(length) is not int or length <= 0):
            raise ValueError(f"--max-seq-len-to-capture must be positive, got {length!r}")

    @property
    def cuda_graph_flags_given(self) -> list[str]:
        """``--cuda-graph-sizes`` and ``--max-seq-len-to-capture``, where set (not defaults)."""
        given = []
        if self.cuda_graph_sizes:
            given.append("--cuda-graph-sizes")
        if self.max_seq_len_to_capture is not None:
            given.append("--max-seq-len-to-capture")
        return given

    @property
    def capture_len(self) -> int:
        """``--max-seq-len-to-capture``, or its default."""
        if self.max_seq_len_to_capture is None:
            return DEFAULT_MAX_SEQ_LEN_TO_CAPTURE
        return self.max_seq_len_to_capture

    @property
    def requested_level(self) -> int:
        """The level ``-O`` / ``--compilation-config`` asked for (or the default)."""
        return self.config.get("level", self.config.get("mode", DEFAULT_COMPILATION_LEVEL))

    @property
    def level(self) -> int:
        """The level the engine runs at: 0 (eager) with ``--enforce-eager``."""
        return 0 if self.enforce_eager else self.requested_level


GUIDED_DECODING_BACKENDS = ("auto", "xgrammar", "guidance")
DEFAULT_COMPILE_TIMEOUT_S = 30.0  # --structured-output-compile-timeout


@dataclass(frozen=True)
class StructuredOutputConfig:
    """``--guided-decoding-*``: the grammar engine of structured output and its JSON defaults."""

    backend: str = "auto"  # xgrammar, and guidance for what xgrammar cannot build
    disable_fallback: bool = False  # auto: xgrammar alone
    disable_any_whitespace: bool = False  # JSON without optional whitespace
    disable_additional_properties: bool = False  # guidance: objects closed to unnamed keys
    max_whitespace: int | None = DEFAULT_MAX_JSON_WHITESPACE  # JSON: per run; None: unbounded
    compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S  # a grammar not compiled by then fails

    def __post_init__(self) -> None:
        if self.max_whitespace is not None and not 0 <= self.max_whitespace <= 10_000:
            raise ValueError(
                "--structured-output-max-whitespace must be 0 to 10000 or none, "
                f"got {self.max_whitespace}"
            )
        if not 0 < self.compile_timeout_s <= 3600:  # also refuses nan
            raise ValueError(
                "--structured-output-compile-timeout must be above 0 and at most 3600 seconds, "
                f"got {self.compile_timeout_s}"
            )
        if self.backend not in GUIDED_DECODING_BACKENDS:
            raise ValueError(
                f"--guided-decoding-backend must be one of {', '.join(GUIDED_DECODING_BACKENDS)}"
                f", got {self.backend!r} (outlines and lm-format-enforcer are not in this build)"
            )


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    compilation: CompilationConfig = field(default_factory=CompilationConfig)
    structured_output: StructuredOutputConfig = field(default_factory=StructuredOutputConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)  # --enable-lora and its settings
    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # --tensor-parallel-size
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)

    def __post_init__(self) -> None:
        check_parallel_options(self.parallel, self.lora.enabled, self.model.runner)
        check_speculative_options(
            self.speculative,
            self.parallel.tensor_parallel_size,
            self.model.runner,
            self.model.batch_invariant,
        )
        if self.model.device == "cpu":
            check_cuda_graph_flags(self.compilation, "cpu")


def check_cuda_graph_flags(compilation: CompilationConfig, device_type: str) -> None:
    """CUDA graphs are captured on a CUDA device only: on another (``device_type``, the device
    the engine runs on) a CUDA graph flag that was set stops start-up; defaults pass."""
    given = compilation.cuda_graph_flags_given
    if device_type == "cuda" or not given:
        return
    raise ValueError(
        f"{' and '.join(given)} size{'s' if len(given) == 1 else ''} CUDA graphs, which are "
        f"captured on a CUDA device only; the engine runs on the {device_type.upper()} here "
        "(--device cpu, or auto where no CUDA device is visible): leave "
        f"{'it' if len(given) == 1 else 'them'} out"
    )
