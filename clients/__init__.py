"""Python clients for llmrpc's gRPC API: ``Client`` (blocking) and ``AsyncClient`` (asyncio).

    from llmrpc.clients import Client
    with Client("127.0.0.1:50051") as client:
        print(client.generate("The capital of France is", max_tokens=8).text)

Failed calls raise ``LlmrpcError`` (``.code``, ``.message``, ``.details``).
"""

from llmrpc.clients.async_client import AsyncClient
from llmrpc.clients.client import Client
from llmrpc.clients.connection import ConnectionOptions, RetryPolicy
from llmrpc.clients.errors import ErrorDetails, FieldViolation, LlmrpcError, ResourceInfo
from llmrpc.clients.requests import ChatOptions, GenerateParams
from llmrpc.clients.types import (
    Completion,
    Delta,
    FinishReason,
    Load,
    ModelCard,
    ModelInfo,
    Sample,
    ServerInfo,
    TokenLogprob,
    Tokens,
    ToolCall,
    TopLogprob,
    Usage,
)

__all__ = [
    "AsyncClient",
    "ChatOptions",
    "Client",
    "Completion",
    "ConnectionOptions",
    "Delta",
    "ErrorDetails",
    "FieldViolation",
    "FinishReason",
    "GenerateParams",
    "LlmrpcError",
    "Load",
    "ModelCard",
    "ModelInfo",
    "ResourceInfo",
    "RetryPolicy",
    "Sample",
    "ServerInfo",
    "TokenLogprob",
    "Tokens",
    "ToolCall",
    "TopLogprob",
    "Usage",
]
