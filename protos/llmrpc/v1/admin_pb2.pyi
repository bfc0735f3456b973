from google.api import annotations_pb2 as _annotations_pb2
from llmrpc.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerCapabilities(_message.Message):
    __slots__ = ("tls", "auth_required", "prefix_caching", "device", "services", "admin_auth_required", "kv_cache_bytes", "device_memory_total_bytes")
    TLS_FIELD_NUMBER: _ClassVar[int]
    AUTH_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHING_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    SERVICES_FIELD_NUMBER: _ClassVar[int]
    ADMIN_AUTH_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MEMORY_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    tls: bool
    auth_required: bool
    prefix_caching: bool
    device: str
    services: _containers.RepeatedScalarFieldContainer[str]
    admin_auth_required: bool
    kv_cache_bytes: float
    device_memory_total_bytes: float
    def __init__(self, tls: _Optional[bool] = ..., auth_required: _Optional[bool] = ..., prefix_caching: _Optional[bool] = ..., device: _Optional[str] = ..., services: _Optional[_Iterable[str]] = ..., admin_auth_required: _Optional[bool] = ..., kv_cache_bytes: _Optional[float] = ..., device_memory_total_bytes: _Optional[float] = ...) -> None: ...

class GetServerInfoResponse(_message.Message):
    __slots__ = ("version", "api_version", "capabilities", "config", "kernels")
    class ConfigEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    VERSION_FIELD_NUMBER: _ClassVar[int]
    API_VERSION_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    KERNELS_FIELD_NUMBER: _ClassVar[int]
    version: str
    api_version: str
    capabilities: ServerCapabilities
    config: _containers.ScalarMap[str, str]
    kernels: _containers.RepeatedCompositeFieldContainer[KernelChoice]
    def __init__(self, version: _Optional[str] = ..., api_version: _Optional[str] = ..., capabilities: _Optional[_Union[ServerCapabilities, _Mapping]] = ..., config: _Optional[_Mapping[str, str]] = ..., kernels: _Optional[_Iterable[_Union[KernelChoice, _Mapping]]] = ...) -> None: ...

class KernelChoice(_message.Message):
    __slots__ = ("op", "num_layers", "rows", "kernel", "times_us")
    class TimesUsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    OP_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    KERNEL_FIELD_NUMBER: _ClassVar[int]
    TIMES_US_FIELD_NUMBER: _ClassVar[int]
    op: str
    num_layers: int
    rows: str
    kernel: str
    times_us: _containers.ScalarMap[str, float]
    def __init__(self, op: _Optional[str] = ..., num_layers: _Optional[int] = ..., rows: _Optional[str] = ..., kernel: _Optional[str] = ..., times_us: _Optional[_Mapping[str, float]] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class GetModelInfoResponse(_message.Message):
    __slots__ = ("model", "max_model_len", "vocab_size", "eos_token_ids", "bos_token_id", "has_chat_template", "dtype", "block_size", "num_kv_blocks", "default_sampling", "default_stopping", "default_output", "runner", "embedding_size")
    class Runner(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        RUNNER_UNSPECIFIED: _ClassVar[GetModelInfoResponse.Runner]
        RUNNER_GENERATE: _ClassVar[GetModelInfoResponse.Runner]
        RUNNER_POOLING: _ClassVar[GetModelInfoResponse.Runner]
    RUNNER_UNSPECIFIED: GetModelInfoResponse.Runner
    RUNNER_GENERATE: GetModelInfoResponse.Runner
    RUNNER_POOLING: GetModelInfoResponse.Runner
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    HAS_CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_STOPPING_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    RUNNER_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_SIZE_FIELD_NUMBER: _ClassVar[int]
    model: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bos_token_id: int
    has_chat_template: bool
    dtype: str
    block_size: int
    num_kv_blocks: int
    default_sampling: _common_pb2.SamplingParams
    default_stopping: _common_pb2.StoppingCriteria
    default_output: _common_pb2.OutputOptions
    runner: GetModelInfoResponse.Runner
    embedding_size: int
    def __init__(self, model: _Optional[str] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., bos_token_id: _Optional[int] = ..., has_chat_template: _Optional[bool] = ..., dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., num_kv_blocks: _Optional[int] = ..., default_sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., default_stopping: _Optional[_Union[_common_pb2.StoppingCriteria, _Mapping]] = ..., default_output: _Optional[_Union[_common_pb2.OutputOptions, _Mapping]] = ..., runner: _Optional[_Union[GetModelInfoResponse.Runner, str]] = ..., embedding_size: _Optional[int] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Model(_message.Message):
    __slots__ = ("id", "max_model_len", "owned_by", "root", "parent")
    ID_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    OWNED_BY_FIELD_NUMBER: _ClassVar[int]
    ROOT_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    id: str
    max_model_len: int
    owned_by: str
    root: str
    parent: str
    def __init__(self, id: _Optional[str] = ..., max_model_len: _Optional[int] = ..., owned_by: _Optional[str] = ..., root: _Optional[str] = ..., parent: _Optional[str] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[Model]
    def __init__(self, models: _Optional[_Iterable[_Union[Model, _Mapping]]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("aborted_request_ids",)
    ABORTED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    aborted_request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, aborted_request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetLoadResponse(_message.Message):
    __slots__ = ("num_running_requests", "num_waiting_requests", "kv_cache_usage", "num_kv_blocks", "prefix_cache_hit_rate", "prompt_throughput", "generation_throughput", "is_sleeping", "kv_cache_bytes", "device_memory_used_bytes", "device_memory_total_bytes", "device_utilization", "engines", "figures_age_seconds", "engine_stalled", "spec_decode")
    NUM_RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_THROUGHPUT_FIELD_NUMBER: _ClassVar[int]
    GENERATION_THROUGHPUT_FIELD_NUMBER: _ClassVar[int]
    IS_SLEEPING_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MEMORY_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MEMORY_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    FIGURES_AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_STALLED_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_FIELD_NUMBER: _ClassVar[int]
    num_running_requests: int
    num_waiting_requests: int
    kv_cache_usage: float
    num_kv_blocks: int
    prefix_cache_hit_rate: float
    prompt_throughput: float
    generation_throughput: float
    is_sleeping: bool
    kv_cache_bytes: float
    device_memory_used_bytes: float
    device_memory_total_bytes: float
    device_utilization: float
    engines: _containers.RepeatedCompositeFieldContainer[EngineLoad]
    figures_age_seconds: float
    engine_stalled: bool
    spec_decode: SpecDecodeCounts
    def __init__(self, num_running_requests: _Optional[int] = ..., num_waiting_requests: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., num_kv_blocks: _Optional[int] = ..., prefix_cache_hit_rate: _Optional[float] = ..., prompt_throughput: _Optional[float] = ..., generation_throughput: _Optional[float] = ..., is_sleeping: _Optional[bool] = ..., kv_cache_bytes: _Optional[float] = ..., device_memory_used_bytes: _Optional[float] = ..., device_memory_total_bytes: _Optional[float] = ..., device_utilization: _Optional[float] = ..., engines: _Optional[_Iterable[_Union[EngineLoad, _Mapping]]] = ..., figures_age_seconds: _Optional[float] = ..., engine_stalled: _Optional[bool] = ..., spec_decode: _Optional[_Union[SpecDecodeCounts, _Mapping]] = ...) -> None: ...

class SpecDecodeCounts(_message.Message):
    __slots__ = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos")
    NUM_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_TOKENS_PER_POS_FIELD_NUMBER: _ClassVar[int]
    num_drafts: float
    num_draft_tokens: float
    num_accepted_tokens: float
    num_accepted_tokens_per_pos: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, num_drafts: _Optional[float] = ..., num_draft_tokens: _Optional[float] = ..., num_accepted_tokens: _Optional[float] = ..., num_accepted_tokens_per_pos: _Optional[_Iterable[float]] = ...) -> None: ...

class EngineLoad(_message.Message):
    __slots__ = ("num_running_requests", "num_waiting_requests", "kv_cache_usage", "num_kv_blocks", "figures_age_seconds", "stalled")
    NUM_RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FIGURES_AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STALLED_FIELD_NUMBER: _ClassVar[int]
    num_running_requests: int
    num_waiting_requests: int
    kv_cache_usage: float
    num_kv_blocks: int
    figures_age_seconds: float
    stalled: bool
    def __init__(self, num_running_requests: _Optional[int] = ..., num_waiting_requests: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., num_kv_blocks: _Optional[int] = ..., figures_age_seconds: _Optional[float] = ..., stalled: _Optional[bool] = ...) -> None: ...

class ResetPrefixCacheRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResetPrefixCacheResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SleepRequest(_message.Message):
    __slots__ = ("level",)
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    level: int
    def __init__(self, level: _Optional[int] = ...) -> None: ...

class SleepResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WakeUpRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WakeUpResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class IsSleepingRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class IsSleepingResponse(_message.Message):
    __slots__ = ("is_sleeping",)
    IS_SLEEPING_FIELD_NUMBER: _ClassVar[int]
    is_sleeping: bool
    def __init__(self, is_sleeping: _Optional[bool] = ...) -> None: ...

class LoraAdapter(_message.Message):
    __slots__ = ("name", "path", "base_model_name")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    base_model_name: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., base_model_name: _Optional[str] = ...) -> None: ...

class LoadLoraAdapterRequest(_message.Message):
    __slots__ = ("lora_name", "lora_path", "base_model_name")
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    lora_path: str
    base_model_name: str
    def __init__(self, lora_name: _Optional[str] = ..., lora_path: _Optional[str] = ..., base_model_name: _Optional[str] = ...) -> None: ...

class LoadLoraAdapterResponse(_message.Message):
    __slots__ = ("adapter",)
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    adapter: LoraAdapter
    def __init__(self, adapter: _Optional[_Union[LoraAdapter, _Mapping]] = ...) -> None: ...

class UnloadLoraAdapterRequest(_message.Message):
    __slots__ = ("lora_name",)
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    def __init__(self, lora_name: _Optional[str] = ...) -> None: ...

class UnloadLoraAdapterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListLoraAdaptersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListLoraAdaptersResponse(_message.Message):
    __slots__ = ("adapters",)
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[LoraAdapter]
    def __init__(self, adapters: _Optional[_Iterable[_Union[LoraAdapter, _Mapping]]] = ...) -> None: ...
