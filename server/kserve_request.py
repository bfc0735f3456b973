"""KServe v2 / Open Inference Protocol requests read as llmrpc generation requests.

A request carries its prompts in the BYTES tensor ``text_input`` (shape [1] or [batch]) and its
tunables as parameters, by the names Triton's vLLM backend and KServe's Hugging Face runtime use
(``max_tokens``, ``temperature``, ``stop``...). They may come three ways, later ones winning:
the ``sampling_parameters`` input (a JSON object, as Triton's vLLM backend takes it), the
request's ``parameters``, and one-element input tensors of the same names (``stream``,
``exclude_input_in_output``...). A wrong value is InvalidArgument naming the parameter.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from llmrpc.server.errors import InvalidArgument
from llmrpc.v1 import generation_pb2

TEXT_INPUT, TEXT_OUTPUT = "text_input", "text_output"
SAMPLING_PARAMETERS = "sampling_parameters"
MAX_STOP_ENTRIES = 64  # a bound of our own; each entry is then bounded by the v1 API's checks

# name -> (GenerateRequest section, its field, kind)
_TUNABLES = {
    "temperature": ("sampling", "temperature", float),
    "top_p": ("sampling", "top_p", float),
    "top_k": ("sampling", "top_k", "int32"),
    "min_p": ("sampling", "min_p", float),
    "seed": ("sampling", "seed", "uint32"),
    "repetition_penalty": ("sampling", "repetition_penalty", float),
    "presence_penalty": ("sampling", "presence_penalty", float),
    "frequency_penalty": ("sampling", "frequency_penalty", float),
    "max_tokens": ("stopping", "max_tokens", "uint32"),
    "min_tokens": ("stopping", "min_tokens", "uint32"),
    "ignore_eos": ("stopping", "ignore_eos", bool),
    "include_stop_str_in_output": ("stopping", "include_stop_str_in_output", bool),
    "skip_special_tokens": ("output", "skip_special_tokens", bool),
    "spaces_between_special_tokens": ("output", "spaces_between_special_tokens", bool),
}
# How the response is made, not what is generated.
_FLAGS = (
    "stream",
    "exclude_input_in_output",
    "return_finish_reason",
    "return_num_input_tokens",
    "return_num_output_tokens",
    "triton_enable_empty_final_response",
)
# The protocol's own parameter of the output encoding (read by the REST gateway): no bearing on
# generation, accepted.
_PROTOCOL = frozenset({"binary_data_output"})
# Triton's scheduling and stateful-model parameters, which this server does not apply: refused
# by name rather than ignored (a client's own deadline bounds a request here).
_NOT_APPLIED = {
    "priority": "request priorities are not applied here",
    "timeout": "give the call a deadline instead (gRPC deadline, or the HTTP client's timeout)",
    "sequence_id": "stateful (sequence) models are not served here",
    "sequence_start": "stateful (sequence) models are not served here",
    "sequence_end": "stateful (sequence) models are not served here",
}
# v1 field paths -> the names a caller here gave them, for errors raised past this module.
V1_FIELD_NAMES = {
    f"{section}.{name}": tunable for tunable, (section, name, _) in _TUNABLES.items()
} | {"stopping.stop": "stop", "stopping.stop_token_ids": "stop_token_ids", "text": TEXT_INPUT}
_INT_RANGES = {"int32": (-(2**31), 2**31 - 1), "uint32": (0, 2**32 - 1)}


@dataclass
class InferRequest:
    """One Open Inference Protocol request, read."""

    prompts: list[str]
    shape: list[int]
    parameters: dict = field(default_factory=dict)  # name -> value, checked
    outputs: list[str] = field(default_factory=lambda: [TEXT_OUTPUT])

    def flag(self, name: str, default: bool = False) -> bool:
        return bool(self.parameters.get(name, default))

    def generate_request(self, prompt: str, model: str) -> generation_pb2.GenerateRequest:
        request = generation_pb2.GenerateRequest(model=model, text=prompt)
        for name, value in self.parameters.items():
            if name in _TUNABLES:
                section, field_name, _ = _TUNABLES[name]
                setattr(getattr(request, section), field_name, value)
        request.stopping.stop.extend(self.parameters.get("stop", ()))
        request.stopping.stop_token_ids.extend(self.parameters.get("stop_token_ids", ()))
        return request


OUTPUTS = {  # output name -> (datatype, the flag that asks for it too)
    TEXT_OUTPUT: ("BYTES", None),
    "finish_reason": ("BYTES", "return_finish_reason"),
    "num_input_tokens": ("UINT32", "return_num_input_tokens"),
    "num_output_tokens": ("UINT32", "return_num_output_tokens"),
}


def read_request(
    texts: list[str], shape: list[int], parameters: dict, requested_outputs: list[str]
) -> InferRequest:
    """``parameters``: every parameter given, in order of precedence (later wins), already
    plain Python values. Raises InvalidArgument naming the wrong one."""
    if not texts:
        raise InvalidArgument(TEXT_INPUT, "give at least one prompt")
    checked = {name: check_parameter(name, value) for name, value in parameters.items()}
    checked = {name: value for name, value in checked.items() if name not in _PROTOCOL}
    if checked.get("stream") and len(texts) != 1:
        raise InvalidArgument(TEXT_INPUT, f"a stream takes one prompt, got {len(texts)}")
    outputs = list(requested_outputs)
    for index, name in enumerate(outputs):
        if name not in OUTPUTS:
            known = ", ".join(OUTPUTS)
            raise InvalidArgument(f"outputs[{index}].name", f"no output {name!r}; known: {known}")
    if not outputs:
        outputs = [name for name, (_, flag) in OUTPUTS.items() if not flag or checked.get(flag)]
    return InferRequest(texts, shape, checked, outputs)


def check_parameter(name: str, value):
    """The value of one parameter, checked against its kind."""
    if name in _PROTOCOL:
        return value
    if name in _NOT_APPLIED:
        raise InvalidArgument(name, _NOT_APPLIED[name])
    if name in _FLAGS:
        return _as_bool(name, value)
    if name == "stop":
        return _string_list(name, value)
    if name == "stop_token_ids":
        return [_as_int(name, item, "uint32") for item in _as_list(name, value)]
    if name not in _TUNABLES:
        known = ", ".join([*_TUNABLES, "stop", "stop_token_ids", *_FLAGS])
        raise InvalidArgument(name, f"unknown parameter; known: {known}")
    kind = _TUNABLES[name][2]
    if kind is bool:
        return _as_bool(name, value)
    if kind is float:
        return _as_float(name, value)
    return _as_int(name, value, kind)


def _as_bool(name: str, value) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"  # Triton's vLLM backend takes strings too
    raise InvalidArgument(name, f"must be true or false, got {value!r}"[:200])


def _as_float(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise InvalidArgument(name, f"must be a number, got {value!r}"[:200])
    try:
        number = float(value)
    except ValueError:
        raise InvalidArgument(name, f"must be a number, got {value!r}"[:200]) from None
    if not math.isfinite(number):
        raise InvalidArgument(name, f"must be a finite number, got {value!r}")
    return number


def _as_int(name: str, value, kind: str) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(name, f"must be an integer, got {value!r}"[:200])
    low, high = _INT_RANGES[kind]
    if not low <= value <= high:
        raise InvalidArgument(name, f"must be between {low} and {high}, got {value}")
    return value


def _as_list(name: str, value) -> list:
    if isinstance(value, str) and value.startswith("["):
        try:
            value = json.loads(value)
        except ValueError:
            raise InvalidArgument(name, "is not a JSON list") from None
    items = value if isinstance(value, list) else [value]
    if len(items) > MAX_STOP_ENTRIES:
        raise InvalidArgument(name, f"at most {MAX_STOP_ENTRIES} entries, got {len(items)}")
    return items


def _string_list(name: str, value) -> list[str]:
    # a string is one stop string, even one that starts with "["
    items = _as_list(name, value) if isinstance(value, list) else [value]
    for item in items:
        if not isinstance(item, str):
            raise InvalidArgument(name, f"must be a string or a list of strings, got {item!r}")
    return items


def sampling_parameters(raw: bytes | str) -> dict:
    """The ``sampling_parameters`` input: a JSON object of parameters."""
    try:
        value = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise InvalidArgument(SAMPLING_PARAMETERS, "must be a JSON object") from None
    if not isinstance(value, dict):
        raise InvalidArgument(SAMPLING_PARAMETERS, "must be a JSON object")
    return value


def decode_text(name: str, raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidArgument(name, "must be UTF-8 text") from None
