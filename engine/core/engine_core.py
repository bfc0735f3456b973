"""The engine core: owns the model, KV cache, scheduler and sampler, and runs one step at a time.

Synchronous and single-threaded; ``AsyncEngine`` drives it from a thread of its own.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from llmrpc.engine.config import CacheConfig, EngineConfig, ModelConfig, check_cuda_graph_flags
from llmrpc.engine.core.draft import DraftModel
from llmrpc.engine.core.input_processor import InputLimits, InputProcessor
from llmrpc.engine.core_types import EngineStateError, EngineStats, KernelChoice, ModelInfo
from llmrpc.engine.loading import loader
from llmrpc.engine.loading.generation_config import sampling_defaults
from llmrpc.engine.lora.manager import build_lora_manager, resolve_adapter
from llmrpc.engine.lora.types import LORA_OFF
from llmrpc.engine.memory import release_free_memory
from llmrpc.engine.metrics import RateMeter
from llmrpc.engine.models import LlamaForCausalLM, build_model, model_class, unstack_experts
from llmrpc.engine.models.llama import layer_windows
from llmrpc.engine.models.moe import FusedExperts
from llmrpc.engine.models.rotary import rope_parameters
from llmrpc.engine.models.transformers_impl import TransformersForCausalLM
from llmrpc.engine.output.output_processor import OutputProcessor
from llmrpc.engine.parallel.executor import start_tensor_parallel
from llmrpc.engine.pooling.pooler import EnginePooling
from llmrpc.engine.quantization.layers import QuantizedLinear
from llmrpc.engine.quantization.plan import describe_linear_layers, plan_quantization
from llmrpc.engine.quantization.tuning import plan_quantized_kernels
from llmrpc.engine.request import (
    FinishReason,
    InvalidRequestError,
    Request,
    RequestOutput,
    SamplingParams,
)
from llmrpc.engine.runner.cuda_graphs import plan_decode_graphs
from llmrpc.engine.runner.device import (
    DeviceMonitor,
    resolve_attention_backend,
    resolve_device,
)
from llmrpc.engine.runner.kernel_warm_up import (
    triton_cache_dir,
    warm_up_triton_kernels,
    warms_up_triton,
)
from llmrpc.engine.runner.model_runner import ModelRunner, kv_bytes_per_block
from llmrpc.engine.runner.threads import (
    ThreadBudget,
    configure_engine_threads,
    cpu_threads,
    idle_core_budget,
)
from llmrpc.engine.runner.weight_arena import gather_weights
from llmrpc.engine.sample.sampler import Sampler, token_logprobs
from llmrpc.engine.sched.kv_cache import KVCacheManager
from llmrpc.engine.sched.scheduler import Scheduler, SchedulerOutput
from llmrpc.engine.spec_decode.config import check_speculative_options
from llmrpc.engine.spec_decode.ngram import NgramProposer
from llmrpc.engine.structured_output import grammar as structured_output
from llmrpc.engine.structured_output.compiler import GrammarCompiler
from llmrpc.engine.structured_output.grammar import Grammar
from llmrpc.engine.structured_output.step import GrammarStep
from llmrpc.engine.timings import record_step, start_timings
from llmrpc.kernels import attention, cpu_ops
from llmrpc.kernels.attention_tuning import AttentionChoice, plan_attention
from llmrpc.kernels.linear import PackedLinear, pack_linear_layers
from llmrpc.kernels.linear_tuning import LayerChoice, bucket_name, layouts, plan_linear_kernels

logger = logging.getLogger(__name__)

_DTYPES = {
    "half": torch.float16,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float": torch.float32,
    "float32": torch.float32,
}


# --kv-cache-dtype -> the cache's torch dtype ("auto": the model's)
_KV_CACHE_DTYPES = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def resolve_dtype(name: str, hf_config) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    # As on vLLM's CPU backend: bfloat16 unless the checkpoint is already in another half type.
    config_dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    return torch.float16 if config_dtype in (torch.float16, "float16") else torch.bfloat16


def resolve_max_model_len(requested: int | None, hf_config, why_capped: str | None = None) -> int:
    """The context: ``--max-model-len``, at most the model's; ``why_capped`` (None: the model's
    layers attend within their windows) caps it at the model's shortest attention window."""
    limit = hf_config.max_position_embeddings
    windows = [w for w in layer_windows(hf_config) if w is not None]
    window = min(windows, default=None)
    if why_capped is not None and window is not None and window < limit:
        # Within the window, full attention is exact; past it, the model would see too much.
        logger.info(
            "context limited to the model's %d-token attention window (%s)", window, why_capped
        )
        limit = window
    if requested is None:
        return limit
    if requested > limit:
        raise ValueError(
            f"--max-model-len {requested} exceeds the model's context length ({limit}"
            f"{', its attention window' if limit == window else ''})"
        )
    return requested


def kv_window_of(model) -> int | None:
    """How far back the model's attention reaches when every layer attends within a window: the
    largest window; None where a layer attends to all (or the model keeps no windows)."""
    windows = [
        getattr(getattr(layer, "self_attn", None), "window", None)
        for layer in getattr(model, "layers", ())
    ]
    if not windows or None in windows:
        return None
    return max(windows)


def eos_token_ids_of(hf_config, tokenizer) -> frozenset[int]:
    ids = getattr(hf_config, "eos_token_id", None)
    ids = set(ids if isinstance(ids, list) else [] if ids is None else [ids])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


def apply_config_overrides(hf_config, model_config: ModelConfig):
    """``--hf-overrides``, ``--rope-scaling`` and ``--rope-theta`` on the model's own config."""
    for key, value in model_config.hf_overrides.items():
        setattr(hf_config, key, value)
    if model_config.rope_scaling or model_config.rope_theta is not None:
        params = rope_parameters(hf_config)
        params.update(model_config.rope_scaling)
        if model_config.rope_theta is not None:
            params["rope_theta"] = model_config.rope_theta
        hf_config.rope_parameters = params
    return hf_config


def num_kv_blocks(cache_config, hf_config, dtype: torch.dtype, draft_block_bytes: int = 0) -> int:
    """Blocks of --kv-cache-memory; with a draft model, each block's bytes include the draft's
    block (its cache has as many)."""
    if cache_config.num_gpu_blocks_override:
        return cache_config.num_gpu_blocks_override
    block_bytes = kv_bytes_per_block(hf_config, cache_config.block_size, dtype)
    return int(cache_config.kv_cache_memory_gib * 2**30 // (block_bytes + draft_block_bytes))


def check_capacity(config: EngineConfig, max_model_len: int, num_blocks: int) -> None:
    """One sequence of max_model_len must fit the KV cache, and one step without chunking."""
    scheduler = config.scheduler
    if not scheduler.enable_chunked_prefill and scheduler.max_num_batched_tokens < max_model_len:
        raise ValueError(
            f"--max-num-batched-tokens {scheduler.max_num_batched_tokens} is smaller than "
            f"--max-model-len {max_model_len}: without chunked prefill a whole prompt must fit "
            "in one step"
        )
    num_tokens = num_blocks * config.cache.block_size
    if num_tokens < max_model_len:
        raise ValueError(
            f"the KV cache holds {num_tokens} tokens, less than one sequence of "
            f"--max-model-len {max_model_len}: lower --max-model-len or give the cache more "
            "room (--kv-cache-memory, --num-gpu-blocks-override)"
        )


def check_batch_invariant(model, attention_backend: str, kv_in_model_dtype: bool) -> None:
    """``--batch-invariant`` holds where each step's numbers for a row do not depend on the other
    rows: every matmul is our blocked bfloat16 kernel (one float32 chain per output, the same
    for any number of rows), and on the torch backend attention is the C++ decode kernel (one
    row at a time). Elsewhere it is refused, naming what is missing."""
    if attention_backend == "torch" and not cpu_ops.loaded():
        raise ValueError(
            "--batch-invariant needs the C++ CPU kernels on the torch backend; they did not "
            "build here (the log says why)"
        )
    if attention_backend == "torch" and not kv_in_model_dtype:
        raise ValueError(
            "--batch-invariant with an fp8 KV cache needs --attention-backend triton: the C++ "
            "decode kernel, which the torch backend needs for it, reads the model's dtype only"
        )
    if any(isinstance(module, FusedExperts) for module in model.modules()):
        raise ValueError(
            "--batch-invariant does not cover MoE models: the router's matmul and the experts' "
            "grouping by step run kernels whose sums depend on the batch"
        )
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear | PackedLinear | QuantizedLinear):
            raise ValueError(
                "--batch-invariant needs every linear layer in our blocked bfloat16 kernel "
                "(--dtype bfloat16, no --quantization, a CPU with AVX512-BF16 or AVX2); "
                f"{name} is {type(module).__name__}, whose reduction order depends on the batch"
            )


def kernel_choices(plan: dict[str, LayerChoice | AttentionChoice]) -> tuple[KernelChoice, ...]:
    """The measured choices as GetServerInfo reports them: one per shape and bucket of rows
    (a prompt chunk's attention from two rows)."""
    rows = []
    for choice in plan.values():
        first = choice.first_bucket if isinstance(choice, AttentionChoice) else 0
        for index, kernel in enumerate(choice.kernels[first:], first):
            times = {k: t[index] for k, t in choice.times_us.items() if t[index] is not None}
            bucket = bucket_name(index)
            rows.append(KernelChoice(choice.op, choice.num_layers, bucket, kernel, times))
    return tuple(rows)


@dataclass
class _StepPlan:
    """A step as scheduled: the batch (None: nothing to run), the requests it ended already,
    its grammars' masks."""

    scheduled: SchedulerOutput | None
    ended: list[RequestOutput]
    grammar_masks: object


@dataclass
class _StepResult:
    """A step as executed: the rows that sampled and their tokens and logprobs by request id,
    the pooled hidden rows, the requests that failed (with why), and (forward started, forward
    seconds, execute seconds)."""

    requests: list[Request]
    tokens: dict
    logprobs: dict
    pooled: object
    failed: dict[Request, str]
    timing: tuple[float, float, float]
    draft_logits: dict  # request -> [num_drafts, vocab_size]: the rows after its drafts


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        """Build the engine on the thread (or process) that will step it: the torch thread
        count set here holds for the calling thread."""
        self.parallel = None
        try:
            self._build(config)
        except BaseException:
            if self.parallel is not None:  # the other ranks started: end them now, not at exit
                self.parallel.close(now=True)
            raise

    def _build(self, config: EngineConfig) -> None:
        configure_engine_threads()
        triton_cache_dir()  # compiled kernels kept in the model cache folder, unless set
        self.thread_budget: ThreadBudget | None = None
        # a compiled engine's budget moves its kernels' threads alone (csrc/kernel_threads.h)
        self._budget_kernels_only = False
        self._kernel_threads = 0
        # shape -> measured choice (CPU): the linear layers', attention's
        self.measured_kernels: dict[str, LayerChoice | AttentionChoice] = {}
        model_config, cache_config = config.model, config.cache
        self.model_config = model_config
        self.model_dir = loader.resolve_model_dir(model_config.model)
        self.hf_config = apply_config_overrides(loader.load_hf_config(self.model_dir), model_config)
        self.tokenizer = (
            None
            if model_config.skip_tokenizer_init
            else loader.load_tokenizer(model_config.tokenizer or self.model_dir)
        )
        self.sampling_defaults = sampling_defaults(
            model_config.generation_config,
            self.model_dir,
            model_config.override_generation_config,
            packaged=model_config.model is None,
        )
        self.dtype = resolve_dtype(model_config.dtype, self.hf_config)
        self.kv_cache_dtype = _KV_CACHE_DTYPES.get(cache_config.cache_dtype, self.dtype)
        self.device = resolve_device(model_config.device)
        self.attention_backend = resolve_attention_backend(
            model_config.attention_backend, self.device
        )
        self.max_model_len = resolve_max_model_len(
            model_config.max_model_len, self.hf_config, self._why_windows_capped()
        )
        self.pooling = EnginePooling(model_config, self.hf_config, self.model_dir)
        requested_len = model_config.max_model_len
        self.max_model_len = self.pooling.max_model_len(self.max_model_len, requested_len)
        self._check_device_options(config)
        self.device_monitor = DeviceMonitor(self.device)
        block_size = cache_config.block_size
        # --speculative-config method draft_model: checked before any weights load
        self.draft = None
        draft_block_bytes = 0
        if config.speculative.method == "draft_model":
            tokenizer = self.tokenizer or loader.load_tokenizer(
                model_config.tokenizer or self.model_dir
            )
            self.draft = DraftModel(config.speculative, tokenizer)
            draft_block_bytes = self.draft.kv_bytes_per_block(block_size, self.kv_cache_dtype)
        profile = self.device.type == "cuda" and not cache_config.num_gpu_blocks_override
        if profile:  # a cache for the profiled step; the real one is sized after it
            num_tokens = self._profile_tokens(config)
            num_blocks = -(-num_tokens // block_size)
        else:
            num_blocks = num_kv_blocks(
                cache_config, self.hf_config, self.kv_cache_dtype, draft_block_bytes
            )
            check_capacity(config, self.max_model_len, num_blocks)  # before the slow model load
        # --tensor-parallel-size: the other ranks' processes, which load their shards meanwhile
        self.parallel = start_tensor_parallel(
            config,
            self.hf_config,
            self.device,
            self.pooling.runner,
            num_tokens if profile else None,
        )
        self.model = self._load_model()
        if self.draft is not None:
            self.draft.model = self._load_model(self.draft)
        # None: LoRA is off
        self.lora = build_lora_manager(config, self.model, self.dtype, self.attention_backend)
        # under tensor parallelism the runner's KV cache holds this rank's KV heads
        rank_config = self.parallel.rank_hf_config(self.hf_config) if self.parallel else None
        self.runner = ModelRunner(
            self.model,
            rank_config or self.hf_config,
            num_blocks,
            block_size,
            self.kv_cache_dtype,
            self.attention_backend,
            model_config.batch_invariant,
        )
        self.runner.lora = self.lora
        self.runner.parallel = self.parallel
        # the attention paths of prompt chunks and decode rows, measured (with an fp8 cache:
        # torch's always); under --batch-invariant decode rows keep the C++ kernel
        attention.reset_kernels()  # (what an engine before this one in the process planned)
        cpu_torch = self.device.type == "cpu" and self.attention_backend == "torch"
        heads = getattr(self.hf_config, "num_attention_heads", None)
        if cpu_torch and heads and self.parallel is None and self.kv_cache_dtype == self.dtype:
            stages = ("prefill",) if model_config.batch_invariant else ("prefill", "decode")
            plan = plan_attention(
                heads, self.runner.kv_caches, loader.cache_root() / "kernels", stages
            )
            self.measured_kernels.update(plan)
        if profile:
            num_blocks = self.runner.kv_blocks_on_device(
                num_tokens, config.scheduler.max_num_seqs, config.cache.gpu_memory_utilization
            )
            if self.parallel is not None:  # the same block count on every rank: the fewest
                num_blocks = self.parallel.agree_on_kv_blocks(num_blocks)
            if draft_block_bytes:  # the draft's cache, of as many blocks, shares the memory
                target_bytes = kv_bytes_per_block(self.hf_config, block_size, self.kv_cache_dtype)
                num_blocks = num_blocks * target_bytes // (target_bytes + draft_block_bytes)
            check_capacity(config, self.max_model_len, num_blocks)
            self.runner.resize_kv_cache(num_blocks)
        self.compilation = config.compilation
        tensor_parallel_size = config.parallel.tensor_parallel_size
        if warms_up_triton(self.model, self.attention_backend, self.device, tensor_parallel_size):
            warm_up_triton_kernels(
                self.model, self.runner.kv_caches, block_size,
                config.scheduler.max_num_batched_tokens, self.max_model_len,
            )  # fmt: skip
        self._compile_decode()
        # --cuda-graph-sizes: None where decode steps run eager (a reason logged on CUDA)
        self.graph_plan = plan_decode_graphs(
            config, self.device, self.model, self.attention_backend, self.max_model_len
        )
        if self.graph_plan is not None:
            self.runner.capture_decode_graphs(self.graph_plan)
        num_seqs, max_len = config.scheduler.max_num_seqs, self.max_model_len
        num_blocks = self.pooling.kv_blocks(num_blocks, num_seqs, max_len, block_size)
        self.kv_manager = KVCacheManager(
            num_blocks,
            block_size,
            cache_config.enable_prefix_caching,
            cache_config.prefix_caching_hash_algo,
            kv_window_of(self.model),
            record_events=cache_config.kv_events,
        )
        scheduler_config = self.pooling.scheduler_config(config.scheduler, self.max_model_len)
        # --speculative-config: the drafts' proposer and its counters (None: no speculation)
        self.proposer = None
        if config.speculative.enabled:  # the runner resolved from the model: pooling refused
            check_speculative_options(
                config.speculative,
                config.parallel.tensor_parallel_size,
                self.pooling.runner,
                model_config.batch_invariant,
            )
            self.proposer = self._proposer(config, num_blocks)
        self.scheduler = Scheduler(
            scheduler_config,
            self.kv_manager,
            self.max_model_len,
            proposer=self.proposer,
            long_rope_from=getattr(self.model, "long_rope_from", None),
        )
        self.scheduler.max_loras = config.lora.max_loras if config.lora.enabled else None
        self.sampler = Sampler(model_config.logprobs_mode, self.attention_backend)
        self.eos_token_ids = eos_token_ids_of(self.hf_config, self.tokenizer)
        self.served_model_names = model_config.served_model_name or (
            loader.default_served_name(model_config.model),
        )
        self.input_processor = InputProcessor(
            InputLimits(self.max_model_len, self.hf_config.vocab_size, model_config.max_logprobs),
            self.tokenizer,
            self.eos_token_ids,
        )
        self.output_processor = OutputProcessor(self.tokenizer, model_config.seed)
        self.structured_config = config.structured_output
        self.grammar_compiler = None
        if self.tokenizer is not None:
            self.grammar_compiler = GrammarCompiler(
                self.tokenizer,
                self.hf_config.vocab_size,
                self.eos_token_ids,
                timeout_s=self.structured_config.compile_timeout_s,
            )
        self.grammar_step = GrammarStep(self.hf_config.vocab_size)
        self._generation_rate = RateMeter()
        self._prompt_rate = RateMeter()
        # The fastest pace seen: an optimistic estimate, so no request is dropped that might
        # still have made its deadline.
        self._peak_tokens_per_second = 0.0
        self.sleep_level = 0  # 0: awake; 1: KV cache dropped; 2: weights dropped too
        # A host KV cache's pages faulted in ahead of use: the blocks handed out so far and as
        # many again as two steps can take (their new tokens, a block per sequence).
        margin = 2 * (
            -(-scheduler_config.max_num_batched_tokens // block_size)
            + scheduler_config.max_num_seqs
        )
        pool = weakref.ref(self.kv_manager.pool)  # the thread must not keep the engine alive
        for runner in filter(None, (self.runner, self.draft and self.proposer.runner)):
            runner.populate_ahead(lambda: None if (p := pool()) is None else p.high_water + margin)
        logger.info(
            "KV cache: %d blocks of %d tokens on %s; attention backend %s",
            num_blocks,
            block_size,
            self.device,
            self.attention_backend,
        )

    def _why_windows_capped(self) -> str | None:
        """Why the layers' attention windows are not served (the context is capped at the
        window instead); None where they are: a native model."""
        if not any(layer_windows(self.hf_config)):
            return None
        if self.model_config.disable_sliding_window:
            return "--disable-sliding-window"
        model = model_class(self.hf_config, self.model_config.model_impl)
        if not issubclass(model, LlamaForCausalLM):
            return f"{model.__name__} attends over all of it"
        return None

    def _proposer(self, config: EngineConfig, num_blocks: int):
        speculative = config.speculative
        if self.draft is not None:
            return self.draft.proposer(
                num_blocks,
                config.cache.block_size,
                self.kv_cache_dtype,
                self.attention_backend,
                self.max_model_len,
                self.hf_config.vocab_size,
                config.scheduler.max_num_batched_tokens,
            )
        logger.info(
            "speculative decoding: ngram, %d draft tokens from %d- to %d-token matches",
            speculative.num_speculative_tokens,
            speculative.prompt_lookup_min,
            speculative.prompt_lookup_max,
        )
        return NgramProposer(speculative)

    def _check_device_options(self, config: EngineConfig) -> None:
        cuda = self.device.type == "cuda"
        check_cuda_graph_flags(config.compilation, self.device.type)
        level = config.compilation.level
        if level and cuda and self.attention_backend != "triton":
            raise ValueError(
                f"-O / --compilation-config level {level} compiles the decode step on CUDA "
                "with --attention-backend triton (auto's choice there) only; with "
                f"{self.attention_backend} use level 0 (or --enforce-eager)"
            )
        if cuda and self.model_config.batch_invariant:
            raise ValueError(
                "--batch-invariant is refused on CUDA: linear layers run cuBLAS there, whose "
                "reduction order depends on the batch"
            )
        if cuda and self.model_config.quantization:
            raise ValueError(
                f"--quantization {self.model_config.quantization} packs weights for the CPU "
                "kernels; on CUDA the engine serves unquantized weights (or use --device cpu)"
            )
        if not cuda and config.cache.gpu_memory_utilization != CacheConfig.gpu_memory_utilization:
            logger.warning(
                "--gpu-memory-utilization sizes the KV cache on a CUDA device; on the CPU "
                "--kv-cache-memory does (%.2f GiB)",
                config.cache.kv_cache_memory_gib,
            )

    def _profile_tokens(self, config: EngineConfig) -> int:
        """Tokens of the largest step the scheduler may make."""
        scheduler = config.scheduler
        if scheduler.enable_chunked_prefill:
            return scheduler.max_num_batched_tokens
        return max(scheduler.max_num_batched_tokens, self.max_model_len)

    def _load_model(self, draft: DraftModel | None = None):
        """The served model's weights (or ``draft``'s, unquantized), ready for the runner: on
        the CPU packed for the linear kernels measured for its shapes."""
        model_dir = draft.model_dir if draft else self.model_dir
        hf_config = draft.hf_config if draft else self.hf_config
        config = self.model_config
        dummy = config.load_format == "dummy"
        weights = None if dummy else loader.iter_weights(model_dir)
        logger.info("loading %s (%s)", model_dir, self.dtype)
        model = build_model(
            hf_config,
            self.dtype,
            weights,
            config.seed,
            config.model_impl,
            quantization=None if draft else plan_quantization(config),
        )
        if self.parallel is not None:  # before packing: the shards are packed, not the whole
            self.parallel.shard(model)
        if self.device.type != "cpu":
            return model.to(self.device)
        if not isinstance(model, TransformersForCausalLM):  # whose code may read .weight
            if self.attention_backend == "torch":  # the Triton path keeps them fused
                unstack_experts(model)  # packed as the linear layers they become
            kernels = plan_linear_kernels(
                model, loader.cache_root() / "kernels", uniform=config.batch_invariant
            )
            packed = pack_linear_layers(model, layouts(kernels))
            logger.info(
                "%s", describe_linear_layers(model, packed, None if draft else config.quantization)
            )
            kernels |= plan_quantized_kernels(model, loader.cache_root() / "kernels")
            self.measured_kernels.update(kernels)
            for choice in kernels.values():
                logger.info("linear kernels: %s", choice.describe())
        moved, huge = gather_weights(model)
        logger.info(
            "weights: %.1f MB in one buffer in step order, on %s pages",
            moved / 1e6,
            "2 MiB" if huge else "4 KiB (no transparent huge pages here)",
        )
        release_free_memory()  # the float weights that loading, quantizing or packing replaced
        cpu_ops.load()  # the C++ decode attention; the torch path where it cannot be built
        if config.batch_invariant:
            check_batch_invariant(model, self.attention_backend, self.kv_cache_dtype == self.dtype)
        return model

    def _compile_decode(self) -> None:
        """At load, before any request: -O1 to -O3 compile the decode step."""
        compilation = self.compilation
        if compilation.enforce_eager and compilation.requested_level:
            logger.warning(
                "--enforce-eager overrides --compilation-config level %d: the engine runs eager",
                compilation.requested_level,
            )
        fp8_in_torch = self.kv_cache_dtype != self.dtype and self.attention_backend == "torch"
        if compilation.level and fp8_in_torch:  # the Triton kernels store and read fp8 in the graph
            logger.warning(
                "decode steps run eager, not compiled: the KV cache is %s (compiled on "
                "--attention-backend triton only)",
                self.kv_cache_dtype,
            )
        elif compilation.level:
            self.runner.compile_decode()

    @property
    def model_info(self) -> ModelInfo:
        return ModelInfo(
            served_model_names=self.served_model_names,
            max_model_len=self.max_model_len,
            vocab_size=self.hf_config.vocab_size,
            eos_token_ids=self.eos_token_ids,
            bos_token_id=getattr(self.tokenizer, "bos_token_id", None)
            if self.tokenizer is not None
            else getattr(self.hf_config, "bos_token_id", None),
            has_chat_template=bool(getattr(self.tokenizer, "chat_template", None)),
            sampling_defaults=dict(self.sampling_defaults),
            dtype=str(self.dtype).removeprefix("torch."),
            block_size=self.kv_manager.block_size,
            num_kv_blocks=self.kv_manager.num_blocks,
            model_dir=str(self.model_dir),
            structured_output=self.structured_config,
            runner=self.pooling.runner,
            embedding_size=self.pooling.hidden_size,
            kernels=kernel_choices(self.measured_kernels),
        )

    @property
    def stats(self) -> EngineStats:
        if self.parallel is not None:  # a dead rank fails the engine, even an idle one
            self.parallel.check()
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=self.scheduler.num_waiting,
            num_free_blocks=self.kv_manager.num_free_blocks,
            num_total_blocks=self.kv_manager.num_blocks,
            prefix_cache_hit_rate=self.kv_manager.num_prefix_hits
            / max(self.kv_manager.num_prefix_queries, 1),
            generation_throughput=self._generation_rate.rate(),
            prompt_throughput=self._prompt_rate.rate(),
            is_sleeping=self.sleep_level > 0,
            kv_cache_bytes=self.runner.kv_cache_bytes,
            spec_decode=self.proposer.stats.counts() if self.proposer is not None else None,
            **self.device_monitor.figures(),
        )

    @property
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        """Queue a request (n samples); raises ``InvalidRequestError`` naming a wrong field."""
        if self.sleep_level:
            raise EngineStateError("the engine is asleep; wake it up first")
        self.pooling.check(params)
        requests = self.input_processor.make_requests(request_id, prompt_token_ids, params)
        if params.lora_name is not None:
            lora = resolve_adapter(self.lora, params.lora_name)
            for request in requests:
                request.lora = lora
        if params.pooling is not None:
            self.pooling.attach(requests, params)
        taken = self.output_processor.children.keys() | self.scheduler.requests.keys()
        if request_id in taken or any(r.request_id in taken for r in requests):
            raise InvalidRequestError("request_id", f"{request_id!r} is already in use")
        if params.structured_output is not None:
            self._attach_grammars(requests, params)
        self.output_processor.add(request_id, requests)
        if params.collect_timings:
            start_timings(requests)
        for request in requests:
            if params.prompt_logprobs is not None:
                request.prompt_logprobs = [None]  # the first prompt token has no logprob
            self.scheduler.add_request(request)

    def _attach_grammars(self, requests: list[Request], params: SamplingParams) -> None:
        """Compile the requests' structured output (one grammar for the n samples), off this
        thread; the scheduler holds them until it is ready."""
        if self.grammar_compiler is None:
            raise InvalidRequestError(
                "structured_output",
                "needs a tokenizer; this server runs with --skip-tokenizer-init",
            )
        spec, config = params.structured_output, self.structured_config
        structured_output.check_form(spec)  # the rest of the checks run with the compile
        compiled = self.grammar_compiler.submit(spec, config.backend, not config.disable_fallback)
        stop_ids = self.eos_token_ids | set(params.stop_token_ids)
        for request in requests:
            request.grammar = Grammar(spec, compiled, stop_ids)

    def abort_requests(self, request_ids) -> list[RequestOutput]:
        """Finish the live requests among ``request_ids`` at once, freeing their KV blocks."""
        outputs = []
        for request_id in request_ids:
            for child_id in list(self.output_processor.children.get(request_id, ())):
                request = self.scheduler.requests[child_id]
                self.scheduler.finish_request(request, FinishReason.ABORT)
                outputs.append(self._output(request, []))
        return outputs

    def use_idle_cores(self) -> bool:
        """Let each step also take the core left to the frontend while the rest of the machine
        leaves it idle (``engine/runner/threads.py``). Only for an engine in its own process: the
        budget counts this process's CPU time as the engine's. Returns whether it applies (not
        where ``OMP_NUM_THREADS`` fixes the count, or on one core). torch.compile guards its
        graph on torch's thread count, and a change would end it: an engine whose step is
        compiled gives the core to its own kernels alone (linear layers, attention, norms,
        activations, rotary), which take their count apart from torch's."""
        if self.parallel is not None:  # the ranks share the cores, a fixed share each
            return False
        compiled = self.runner.compiled_decode is not None
        if compiled and not cpu_ops.loaded():
            logger.info(
                "engine: %s, fixed: the compiled step's graph holds for that count",
                cpu_threads(torch.get_num_threads()),
            )
            return False
        self.thread_budget = idle_core_budget()
        if self.thread_budget is None:
            return False
        # the first reading now: the first step judges the machine since then, not by default
        self.thread_budget.threads_now()
        self._budget_kernels_only = compiled
        logger.info(
            "engine: %s%s while the rest of the machine uses half a core or more, %d while it "
            "uses less%s",
            "our kernels (linear layers, attention, norms, activations) on " if compiled else "",
            cpu_threads(self.thread_budget.threads),
            self.thread_budget.cores,
            f"; torch's other operations on {cpu_threads(torch.get_num_threads())}, fixed: the "
            "compiled step's graph holds for that count"
            if compiled
            else "",
        )
        return True

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """One step of the batch, in three parts: schedule, execute and sample, update. A fault
        that belongs to one request finishes that request with ``FinishReason.ERROR``; only a
        failed forward pass (or scheduling) raises."""
        started = time.monotonic()
        plan = self._schedule(started)
        if plan.scheduled is None:
            return plan.ended
        result = self._execute(plan)
        return self._update(plan, result, started)

    def _schedule(self, now: float) -> _StepPlan:
        """The scheduler's batch and what it needs before the forward pass: the adapters in
        their slots (LoRA), the threads for its size, the grammars' masks started (they are
        computed while the forward pass runs); its batch None when there is nothing to run (a
        grammar may be compiling). Requests this ends (hopeless, refused, failed adapters) are
        kept for the step's outputs."""
        ended = self._drop_hopeless_waiting(now) + self._admit_compiled()
        proposer = self.scheduler.proposer
        if proposer is not None:  # a draft model runs now, for the scheduler to take its drafts
            proposer.prepare(self.scheduler.running)
        scheduled = self.scheduler.schedule()
        if not scheduled:
            self._wait_for_a_grammar()
            return _StepPlan(None, ended, None)
        if self.lora is not None:
            ended += self._fail_requests(self.lora.prepare(scheduled, self.scheduler.running))
            if not scheduled:
                return _StepPlan(None, ended, None)
        self._prompt_rate.add(
            sum(
                max(0, min(r.num_computed_tokens + n, r.num_prompt_tokens) - r.num_computed_tokens)
                for r, n in scheduled.scheduled
            )
        )
        if self.thread_budget is not None:
            threads = self.thread_budget.threads_now()
            if self._budget_kernels_only:
                if threads != self._kernel_threads:
                    cpu_ops.set_kernel_threads(threads)
                    self._kernel_threads = threads
            elif threads != torch.get_num_threads():
                torch.set_num_threads(threads)
        return _StepPlan(scheduled, ended, self.grammar_step.start(scheduled.scheduled))

    def _execute(self, plan: _StepPlan) -> _StepResult:
        """The forward pass, then what reads its logits: the grammars' masks applied, prompt
        logprobs recorded, the sampled rows' tokens drawn. If the batched sampler fails, the
        requests at fault are found and the others leave the batch, to redo this step."""
        scheduled = plan.scheduled
        forward_started = time.time()
        model_output = self.runner.execute(scheduled, self.kv_manager.block_ids)
        forward_s = time.time() - forward_started
        failed: dict[Request, str] = {}
        self.grammar_step.finish(plan.grammar_masks, model_output.logits.device, failed)
        self._record_prompt_logprobs(model_output.prompt_logits, failed)
        requests = model_output.sampled_requests
        sampled = self._sample(model_output.logits, requests, failed)
        execute_s = time.time() - forward_started
        if sampled is None:  # sampling failed as a batch: the innocent requests redo this step
            redo = set(requests)
            scheduled.scheduled = [(r, n) for r, n in scheduled.scheduled if r not in redo]
            for request in redo:
                request.spec_token_ids = []  # their step is redone, drafts proposed anew
            tokens, logprobs = {}, {}
        else:
            self._generation_rate.add(len(requests))
            ids = [r.request_id for r in requests]
            tokens = dict(zip(ids, sampled.token_ids, strict=True))
            logprobs = dict(zip(ids, sampled.logprobs, strict=True))
        timing = (forward_started, forward_s, execute_s)
        return _StepResult(
            requests, tokens, logprobs, model_output.pooled, failed, timing,
            model_output.draft_logits if sampled is not None else {},
        )  # fmt: skip

    def _update(self, plan: _StepPlan, result: _StepResult, started: float) -> list[RequestOutput]:
        """The step's tokens into the scheduler (finished requests free their blocks), then what
        follows from them: timings, pooled embeddings, the grammars advanced, and each request's
        output (detokenized, stop strings checked)."""
        scheduled, failed = plan.scheduled, result.failed
        updated = self.scheduler.update_from_output(scheduled, result.tokens, failed)
        record_step(scheduled.scheduled, updated, *result.timing)
        pooled = self.pooling.finish(self.scheduler, self._output, result.pooled, failed)
        self.grammar_step.advance(result.requests, updated, failed)
        updated = [request for request in updated if request not in failed]
        for request in updated:
            self._add_token(request, result.logprobs[request.request_id], failed)
        num_new = dict.fromkeys(updated, 1)
        if result.draft_logits:
            self._verify(result.draft_logits, updated, num_new, failed)
        if self.proposer is not None:  # this step's drafts are spent
            for request, _ in scheduled.scheduled:
                request.spec_token_ids = []
        outputs = [
            self._output(r, r.output_token_ids[-num_new[r] :]) for r in updated if r not in failed
        ]
        elapsed = max(time.monotonic() - started, 1e-6)
        if self.proposer is not None:  # what a row costs the whole step, for how many drafts pay
            self.proposer.cost.add(scheduled.num_scheduled_tokens, elapsed)
        pace = scheduled.num_scheduled_tokens / elapsed
        self._peak_tokens_per_second = max(self._peak_tokens_per_second, pace)
        outputs = [output for output in outputs if output is not None]
        outputs = plan.ended + outputs + pooled
        return outputs + self._fail_requests(failed) + self._end_expired_requests()

    def _sample(self, logits: torch.Tensor, requests: list[Request], failed: dict):
        """The batch's tokens; None when the batched sampler failed. Then each request is tried
        alone to find the ones at fault (added to ``failed``); the others redo the step, with
        their random generators as they were, so a seeded request draws the same tokens."""
        generators = [self.output_processor.generator(r.request_id) for r in requests]
        # Only seeded requests promise their draws: saving a generator's state costs ~2 us.
        saved = [
            (g, g.get_state())
            for g, r in zip(generators, requests, strict=True)
            if r.params.seed is not None and not r.params.greedy
        ]
        try:
            return self.sampler(logits, requests, generators)
        except Exception as error:  # noqa: BLE001 - found and charged to its request below
            logger.warning("sampling the batch failed (%r); trying each request alone", error)
        for row, request in enumerate(requests):
            for generator, state in saved:
                generator.set_state(state)
            try:
                self.sampler(logits[row : row + 1].clone(), [request], [generators[row]])
            except Exception as error:  # noqa: BLE001 - this request's own fault
                failed[request] = f"sampling failed: {error!r}"
        for generator, state in saved:
            generator.set_state(state)
        if not any(request in failed for request in requests):
            for request in requests:  # no single culprit: the whole sampled batch fails
                failed[request] = "sampling the batch failed"
        return None

    def _admit_compiled(self) -> list[RequestOutput]:
        """Queue the requests whose grammar has compiled; fail those whose compile failed."""
        if not self.scheduler.compiling:
            return []
        outputs = []
        for request in self.scheduler.compiled():
            outputs.append(self._refuse(request, request.grammar.error()))
        return outputs

    def _refuse(self, request: Request, error: InvalidRequestError) -> RequestOutput:
        """End ``request`` for a fault of its own: the caller's to fix (INVALID_ARGUMENT)."""
        logger.info("request %s refused: %s", request.request_id, error)
        self.scheduler.finish_request(request, FinishReason.ERROR)
        output = self.output_processor.error_output(request, error.message)
        output.error_field = error.field
        return output

    def _wait_for_a_grammar(self, timeout: float = 0.01) -> None:
        """With nothing to compute but grammars compiling: a short wait, not a busy loop."""
        futures = {request.grammar.compiled for request in self.scheduler.compiling}
        if futures:
            concurrent.futures.wait(futures, timeout, concurrent.futures.FIRST_COMPLETED)

    def _fail_requests(
        self, failed: dict[Request, str | InvalidRequestError]
    ) -> list[RequestOutput]:
        """End each request of ``failed``: a message is a fault of ours (INTERNAL); an
        ``InvalidRequestError`` is the caller's to fix (INVALID_ARGUMENT naming its field)."""
        outputs = []
        for request, problem in failed.items():
            if isinstance(problem, InvalidRequestError):
                outputs.append(self._refuse(request, problem))
                continue
            logger.error("request %s failed: %s", request.request_id, problem)
            self.scheduler.finish_request(request, FinishReason.ERROR)
            outputs.append(self.output_processor.error_output(request, problem))
        return outputs

    def _output(self, request: Request, new_token_ids: list[int]) -> RequestOutput:
        """``make_output``, or an error output if making it fails."""
        try:
            return self.output_processor.make_output(request, new_token_ids)
        except Exception as error:  # noqa: BLE001 - this request's own fault
            logger.exception("making the output of %s failed", request.request_id)
            if not request.is_finished:
                self.scheduler.finish_request(request, FinishReason.ERROR)
            message = f"making the output failed: {error!r}"
            return self.output_processor.error_output(request, message)

    def _drop_hopeless_waiting(self, now: float) -> list[RequestOutput]:
        """Drop queued requests that cannot start before their deadline at the recent pace."""
        pace = self._peak_tokens_per_second
        if not pace:
            return []
        outputs, tokens_ahead = [], 0
        for request in list(self.scheduler.waiting):
            deadline = request.params.deadline
            tokens = request.num_tokens - request.num_computed_tokens
            if deadline is not None and now + (tokens_ahead + tokens) / pace > deadline:
                self.scheduler.finish_request(request, FinishReason.DEADLINE)
                outputs.append(self._output(request, []))
            else:
                tokens_ahead += tokens
        return outputs

    def _record_prompt_logprobs(self, prompt_logits, failed: dict) -> None:
        for span, logits in prompt_logits:
            try:
                self._record_span_logprobs(span, logits)
            except Exception as error:  # noqa: BLE001 - this request's own fault
                failed[span.request] = f"computing prompt logprobs failed: {error!r}"

    def _record_span_logprobs(self, span, logits) -> None:
        request = span.request
        values = self.sampler.logprob_values(logits)
        for j in range(span.num_positions):
            target = span.first_position + j + 1
            if target == len(request.prompt_logprobs):  # not recorded before a preemption
                token_id = request.prompt_token_ids[target]
                num_top = request.params.prompt_logprobs
                request.prompt_logprobs.append(token_logprobs(values[j], token_id, num_top))

    def _end_expired_requests(self) -> list[RequestOutput]:
        outputs = []
        for request_id in self.output_processor.expired(time.monotonic()):
            request = self.scheduler.requests[request_id]
            self.scheduler.finish_request(request, FinishReason.TIME_LIMIT)
            outputs.append(self._output(request, []))
        return outputs

    def _add_token(self, request: Request, logprobs, failed: dict) -> None:
        """The request's newest token to its output: detokenized, stop strings checked."""
        # EOS and stop tokens end the output without being rendered as text.
        render = request.finish_reason not in (FinishReason.EOS, FinishReason.STOP_TOKEN)
        try:
            stop = self.output_processor.add_token(request, logprobs, render)
        except Exception as error:  # noqa: BLE001 - this request's own fault
            failed[request] = f"detokenizing the output failed: {error!r}"
            if request.is_finished:  # it ended with this token: say why it failed instead
                request.finish_reason = FinishReason.ERROR
            return
        if stop is not None:
            self.scheduler.finish_request(request, FinishReason.STOP_STRING, stop)

    def _verify(self, draft_logits: dict, updated: list[Request], num_new: dict, failed) -> None:
        """Speculative decoding's verification, one draft position at a time for the whole
        batch. A request whose token just sampled equals its next draft accepts that draft
        (its KV holds) and samples the row after it, with every rule of the sampler applied to
        the request as it now stands (penalties, bad words, min_tokens, its grammar's mask,
        stop tokens and strings ending it): each token is drawn from the target's own
        distribution, the draft only says which row comes next. As the drafts are single
        tokens, this is the standard rule (accept with probability min(1, p/q), else draw from
        the normalised residual) for a proposal q that is certain, and a seeded request draws
        the same tokens as without speculation."""
        candidates = [request for request in updated if request in draft_logits]
        accepted_counts = dict.fromkeys(candidates, 0)
        position = 0
        while candidates:
            accepted = []
            for request in candidates:
                drafts = request.spec_token_ids
                if request.is_finished or request in failed or position >= len(drafts):
                    continue
                if request.output_token_ids[-1] == drafts[position]:
                    accepted_counts[request] += 1
                    accepted.append(request)
            candidates = self._sample_after_drafts(accepted, draft_logits, position, failed)
            for request in candidates:
                num_new[request] += 1
            position += 1
        for request, count in accepted_counts.items():
            self.proposer.verified(request, len(request.spec_token_ids), count)

    def _sample_after_drafts(
        self, requests: list[Request], draft_logits: dict, position: int, failed: dict
    ) -> list[Request]:
        """The token after each request's accepted draft ``position``; returns the requests
        that got one. A draft counts as computed only then: a request the sampler fails is in
        ``failed``, the others recompute the draft (now their last token) next step."""
        if not requests:
            return []
        with_grammar = [r for r in requests if r.grammar is not None and r.grammar.active]
        if with_grammar:
            self.grammar_step.masks_now(with_grammar, draft_logits[requests[0]].device, failed)
        requests = [r for r in requests if r not in failed]
        if not requests:
            return []
        logits = torch.stack([draft_logits[r][position] for r in requests])
        sampled = self._sample(logits, requests, failed)
        if sampled is None:
            self.grammar_step.advance(requests, [], failed)
            return []
        updated = []
        for request, token_id in zip(requests, sampled.token_ids, strict=True):
            try:
                self.scheduler.accept_draft(request)
                self.scheduler.append_token(request, token_id)
            except Exception as error:  # noqa: BLE001 - this request's own fault
                failed[request] = f"updating the request failed: {error!r}"
                continue
            updated.append(request)
        self.grammar_step.advance(requests, updated, failed)
        updated = [r for r in updated if r not in failed]
        for request, logprobs in zip(requests, sampled.logprobs, strict=True):
            if request in updated:
                self._add_token(request, logprobs, failed)
        self._generation_rate.add(len(updated))
        return updated

    def _require_lora(self):
        if self.lora is None:
            raise EngineStateError(LORA_OFF)
        return self.lora

    def load_lora_adapter(self, name: str, path: str, base_model_name: str = "") -> dict:
        return self._require_lora().add(name, path, base_model_name or None)

    def unload_lora_adapter(self, name: str) -> None:
        self._require_lora().remove(name)

    def list_lora_adapters(self) -> list[dict]:
        return [] if self.lora is None else self.lora.list()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False (nothing done) while requests hold blocks."""
        return self.kv_manager.reset_prefix_cache()

    def take_kv_events(self) -> list:
        """The prefix cache's changes since the last call (``engine/kv_events.py``; [] unless
        --kv-events-config enables them)."""
        return self.kv_manager.take_events()

    def sleep(self, level: int) -> None:
        """Free memory while idle: level 1 drops the KV cache, level 2 the weights too."""
        if not self.model_config.enable_sleep_mode:
            raise EngineStateError("sleep mode is off; start the server with --enable-sleep-mode")
        if level not in (1, 2):
            raise InvalidRequestError("level", "must be 1 or 2")
        if self.has_unfinished_requests:
            raise EngineStateError("requests are running; sleep needs an idle engine")
        self.kv_manager.reset_prefix_cache()
        draft_runner = self.proposer.runner if self.draft is not None else None
        for runner in filter(None, (self.runner, draft_runner)):
            runner.free_kv_cache()
        if level == 2:
            self.model = self.runner.model = None
            if draft_runner is not None:
                self.draft.model = draft_runner.model = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # torch's allocator would keep what was freed reserved
        self.sleep_level = max(self.sleep_level, level)
        logger.info("asleep at level %d", self.sleep_level)

    def wake_up(self) -> None:
        draft_runner = self.proposer.runner if self.draft is not None else None
        if self.sleep_level == 2:
            self.model = self.runner.model = self._load_model()
            if self.lora is not None:  # the new model's layers, with empty slots
                self.lora.attach(self.model)
            if draft_runner is not None:
                self.draft.model = draft_runner.model = self._load_model(self.draft)
        if self.sleep_level:
            for runner in filter(None, (self.runner, draft_runner)):
                runner.allocate_kv_cache()
            if self.sleep_level == 2 and self.compilation.level:
                self.runner.compile_decode()  # from inductor's cache, for the new weights
            if self.graph_plan is not None:  # the graphs held the freed cache's addresses
                self.runner.capture_decode_graphs(self.graph_plan)
            logger.info("awake")
        self.sleep_level = 0
