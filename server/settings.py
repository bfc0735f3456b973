"""Frontend settings (where the server listens) and the effective configuration it publishes."""

from __future__ import annotations

from dataclasses import dataclass

from llmrpc.engine.config import EngineConfig
from llmrpc.engine.loader import default_served_name

DEFAULT_GRPC_PORT = 50051
DEFAULT_HTTP_PORT = 8000


@dataclass(frozen=True)
class FrontendConfig:
    """``--host``, ``--grpc-port`` and ``--port`` (the REST gateway's, not served yet)."""

    host: str | None = None  # None: all addresses
    grpc_port: int = DEFAULT_GRPC_PORT
    port: int = DEFAULT_HTTP_PORT

    def __post_init__(self) -> None:
        for flag, value in (("--grpc-port", self.grpc_port), ("--port", self.port)):
            if not 0 <= value <= 65535:
                raise ValueError(f"{flag} must be a port number in [0, 65535], got {value}")


def grpc_bind_address(host: str | None, port: int) -> str:
    """``host:port`` as gRPC wants it: all addresses is ``[::]``, IPv6 literals in brackets."""
    if not host:
        host = "[::]"
    elif ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


def _text(value) -> str:
    if value is None:
        return ""
    if isinstance(value, (tuple, list)):
        return ",".join(map(str, value))
    return str(value)


def effective_config(
    engine_config: EngineConfig, frontend: FrontendConfig, grpc_port: int, model_info=None
) -> dict[str, str]:
    """Serve option name -> effective value, for GetServerInfo (values the engine resolved win)."""
    model, cache, scheduler = engine_config.model, engine_config.cache, engine_config.scheduler
    config = {
        "model": model.model or default_served_name(None),
        "tokenizer": model.tokenizer,
        "served_model_name": model.served_model_name,
        "dtype": model.dtype,
        "max_model_len": model.max_model_len,
        "seed": model.seed,
        "load_format": model.load_format,
        "block_size": cache.block_size,
        "kv_cache_memory": cache.kv_cache_memory_gib,
        "num_gpu_blocks_override": cache.num_gpu_blocks_override,
        "enable_prefix_caching": cache.enable_prefix_caching,
        "max_num_seqs": scheduler.max_num_seqs,
        "max_num_batched_tokens": scheduler.max_num_batched_tokens,
        "host": frontend.host,
        "grpc_port": grpc_port,
        "port": frontend.port,
    }
    if model_info is not None:
        config.update(
            served_model_name=model_info.served_model_names,
            dtype=model_info.dtype,
            max_model_len=model_info.max_model_len,
            num_kv_blocks=model_info.num_kv_blocks,
        )
    return {name: _text(value) for name, value in config.items()}
