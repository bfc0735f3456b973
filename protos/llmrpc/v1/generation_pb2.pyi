from google.api import annotations_pb2 as _annotations_pb2
from llmrpc.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_STOP_STRING: _ClassVar[FinishReason]
    FINISH_REASON_STOP_TOKEN: _ClassVar[FinishReason]
    FINISH_REASON_EOS: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
    FINISH_REASON_TIME_LIMIT: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_STOP_STRING: FinishReason
FINISH_REASON_STOP_TOKEN: FinishReason
FINISH_REASON_EOS: FinishReason
FINISH_REASON_ABORT: FinishReason
FINISH_REASON_TIME_LIMIT: FinishReason
FINISH_REASON_ERROR: FinishReason

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "model", "text", "token_ids", "chat", "sampling", "stopping", "output", "add_special_tokens", "truncate_prompt_tokens", "priority", "structured_output", "lora")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOPPING_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    text: str
    token_ids: _common_pb2.TokenIds
    chat: _common_pb2.Chat
    sampling: _common_pb2.SamplingParams
    stopping: _common_pb2.StoppingCriteria
    output: _common_pb2.OutputOptions
    add_special_tokens: bool
    truncate_prompt_tokens: int
    priority: int
    structured_output: _common_pb2.StructuredOutput
    lora: str
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[_common_pb2.TokenIds, _Mapping]] = ..., chat: _Optional[_Union[_common_pb2.Chat, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., stopping: _Optional[_Union[_common_pb2.StoppingCriteria, _Mapping]] = ..., output: _Optional[_Union[_common_pb2.OutputOptions, _Mapping]] = ..., add_special_tokens: _Optional[bool] = ..., truncate_prompt_tokens: _Optional[int] = ..., priority: _Optional[int] = ..., structured_output: _Optional[_Union[_common_pb2.StructuredOutput, _Mapping]] = ..., lora: _Optional[str] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "token", "logprob", "rank", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    token: str
    logprob: float
    rank: int
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., token: _Optional[str] = ..., logprob: _Optional[float] = ..., rank: _Optional[int] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "token", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    token: str
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., token: _Optional[str] = ..., logprob: _Optional[float] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "finish_reason", "stop_string", "stop_token_id", "usage", "index", "logprobs", "prompt_logprobs", "samples", "reasoning_text", "tool_calls")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    REASONING_TEXT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: FinishReason
    stop_string: str
    stop_token_id: int
    usage: Usage
    index: int
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    samples: _containers.RepeatedCompositeFieldContainer[GenerateResponse]
    reasoning_text: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[_common_pb2.ToolCall]
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., stop_string: _Optional[str] = ..., stop_token_id: _Optional[int] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., index: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., samples: _Optional[_Iterable[_Union[GenerateResponse, _Mapping]]] = ..., reasoning_text: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[_common_pb2.ToolCall, _Mapping]]] = ...) -> None: ...
