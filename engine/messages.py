"""The typed messages between the frontend and the engine core: msgspec Structs, msgpack.

The same messages flow whether the core steps on a thread of the server's process (objects
handed over as they are) or in a process of its own (encoded with msgspec over ZeroMQ). Only
data crosses: requests, sampling parameters, outputs, figures and errors, as their engine
dataclasses; never a pickled object.

Frontend to core: ``AddRequest``, ``Abort``, ``Call`` (a utility: ``reset_prefix_cache``,
``sleep``, ``wake_up``, LoRA's, and those engine plug-ins register), ``Shutdown``. Core to frontend:
``Ready`` (once loaded), ``Outputs`` (each step), ``Result`` (of a command that asked for one),
``Figures`` (while idle), ``KVEvents`` (the prefix cache's changes, after the step or command that
made them, with --kv-events-config), ``Log`` (a log record of the engine process), ``Fatal``
(loading failed or the step loop died).
"""

from __future__ import annotations

import traceback
from typing import Any, Union

import msgspec

from llmrpc.engine.config import EngineConfig
from llmrpc.engine.core_types import EngineStateError, EngineStats, ModelInfo
from llmrpc.engine.kv_events import KVEvent
from llmrpc.engine.lora.types import LoRAAdapterExistsError, LoRAAdapterNotFoundError
from llmrpc.engine.request import InvalidRequestError, RequestOutput, SamplingParams

# --- figures and errors ---------------------------------------------------------------------


class Snapshot(msgspec.Struct, array_like=True):
    """The core's figures as of one moment, whole."""

    stats: EngineStats
    device: str  # where the model's weights are, as torch names it


class ErrorInfo(msgspec.Struct, array_like=True):
    """An exception, by the names of its classes, most derived first, and its message."""

    types: list[str]
    message: str
    field: str | None = None  # InvalidRequestError's field
    traceback: str = ""


class EngineDeadError(RuntimeError):
    """The step loop stopped on an error; no request can be served any more."""


class RemoteTraceback(Exception):
    """The engine process's traceback of an error, as the cause of the error rebuilt here."""

    def __str__(self) -> str:
        return self.args[0]


# The types an error keeps across the boundary (the server maps several to gRPC codes); any
# other error arrives as the nearest of these its class derives from.
_ERROR_TYPES: dict[str, type[BaseException]] = {
    cls.__name__: cls
    for cls in (
        EngineDeadError,
        EngineStateError,
        LoRAAdapterNotFoundError,  # NOT_FOUND
        LoRAAdapterExistsError,  # ALREADY_EXISTS
        FileNotFoundError,
        PermissionError,
        IsADirectoryError,
        NotADirectoryError,
        OSError,
        KeyError,
        IndexError,
        TypeError,
        ValueError,
        NotImplementedError,
        MemoryError,
        RuntimeError,
    )
}


def error_info(error: BaseException, with_traceback: bool = False) -> ErrorInfo:
    types = [cls.__name__ for cls in type(error).__mro__]
    text = "".join(traceback.format_exception(error)) if with_traceback else ""
    if isinstance(error, InvalidRequestError):
        return ErrorInfo(types, error.message, error.field, text)
    if isinstance(error, KeyError) and len(error.args) == 1:
        return ErrorInfo(types, str(error.args[0]), None, text)
    return ErrorInfo(types, str(error), None, text)


def rebuild_error(info: ErrorInfo) -> BaseException:
    """The error ``info`` describes, as the nearest type this side knows."""
    if "InvalidRequestError" in info.types:
        error: BaseException = InvalidRequestError(info.field or "", info.message)
    else:
        # The type itself if known here, else the nearest known one, its name in the message.
        known = next((name for name in info.types if name in _ERROR_TYPES), "RuntimeError")
        message = info.message if known == info.types[0] else f"{info.types[0]}: {info.message}"
        error = _ERROR_TYPES[known](message)
    if info.traceback:
        error.__cause__ = RemoteTraceback(f"\n\nin the engine process:\n{info.traceback}")
    return error


# --- frontend to core -------------------------------------------------------------------------


class AddRequest(msgspec.Struct, tag=True, array_like=True):
    call_id: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


class Abort(msgspec.Struct, tag=True, array_like=True):
    call_id: int  # 0: no reply wanted
    request_ids: list[str]


class Call(msgspec.Struct, tag=True, array_like=True):
    call_id: int
    method: str  # a utility's name: core.process.UTILITIES, or an engine plug-in's
    args: list[Any] = []


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    pass


ToCore = Union[AddRequest, Abort, Call, Shutdown]  # noqa: UP007 - msgspec wants a Union here


# --- core to frontend -------------------------------------------------------------------------


class Ready(msgspec.Struct, tag=True, array_like=True):
    model_info: ModelInfo
    snapshot: Snapshot


class Outputs(msgspec.Struct, tag=True, array_like=True):
    outputs: list[RequestOutput]
    snapshot: Snapshot  # as of these outputs


class Result(msgspec.Struct, tag=True, array_like=True):
    call_id: int
    snapshot: Snapshot  # as of the command's end
    value: Any = None
    error: ErrorInfo | None = None


class Figures(msgspec.Struct, tag=True, array_like=True):
    snapshot: Snapshot


class KVEvents(msgspec.Struct, tag=True, array_like=True):
    """The prefix cache's changes since the previous ``KVEvents``, in order."""

    events: list[KVEvent]
    timestamp: float  # time.time() when taken


class Log(msgspec.Struct, tag=True, array_like=True):
    """A log record of the engine process, re-emitted by the frontend's logging."""

    name: str
    levelno: int
    levelname: str
    message: str  # formatted with its arguments
    created: float
    pathname: str
    lineno: int
    func_name: str
    exc_text: str | None = None


class Fatal(msgspec.Struct, tag=True, array_like=True):
    error: ErrorInfo
    while_loading: bool


FromCore = Union[Ready, Outputs, Result, Figures, KVEvents, Log, Fatal]  # noqa: UP007


class Startup(msgspec.Struct, array_like=True):
    """What the engine process reads from its standard input before anything else."""

    to_core: str  # ZeroMQ address the frontend sends to
    from_core: str  # ZeroMQ address the frontend receives on
    config: EngineConfig
    log_level: int
