"""The OpenAI parameter a 400 is about, written as OpenAI writes it (``max_tokens``,
``messages[0].content``), from a gRPC BadRequest field path (``stopping.max_tokens``,
``chat.messages[0].content``) or a pydantic error location (``("body", "messages", 0,
"content")``).
"""

from __future__ import annotations

import re

# GenerateRequest field paths (a path or the path of anything under it) -> the completions
# parameter; None: nothing the caller sent (the gateway's own settings).
COMPLETION_PARAMS: dict[str, str | None] = {
    "text": "prompt",
    "token_ids.ids": "prompt",
    "token_ids": "prompt",
    "input": "prompt",
    "output.prompt_logprobs": "logprobs",  # set from logprobs when echoing
    "stopping.time_limit_ms": None,
    "lora": "model",  # a model name that is no served model's is a LoRA adapter's
}

# The same for chat completions: the prompt is the messages.
CHAT_PARAMS: dict[str, str | None] = {
    **COMPLETION_PARAMS,
    "text": "messages",
    "token_ids.ids": "messages",
    "token_ids": "messages",
    "input": "messages",
    "chat.messages": "messages",
    "chat": "messages",
    "output.logprobs": "top_logprobs",
    "output.prompt_logprobs": "prompt_logprobs",
}

# Sub-messages of GenerateRequest whose fields are top-level OpenAI parameters.
SECTIONS = ("sampling", "stopping", "output", "chat")

_STEP = re.compile(r"[.\[]")


def _heads(field: str):
    """(head, rest) splits of a path, longest head first: ``a.b[0]`` -> ``a.b[0]``, ``a.b``,
    ``a``."""
    yield field, ""
    for cut in reversed([m.start() for m in _STEP.finditer(field)]):
        yield field[:cut], field[cut:]


def param_of(field: str, names: dict[str, str | None] | None = None) -> str | None:
    """The OpenAI parameter a gRPC field path names, keeping its indices and sub-fields."""
    names = COMPLETION_PARAMS if names is None else names
    for head, rest in _heads(field):
        if head in SECTIONS and rest:
            continue  # "chat" alone is the messages; "chat.x" is a parameter of its own
        if head in names:
            name = names[head]
            return None if name is None else name + rest
    section, dot, rest = field.partition(".")
    return rest if dot and section in SECTIONS else field


# pydantic puts the member of a union it tried into error locations: "str", "list[int]",
# "constrained-int", "function-after[...]", or a model's class name. They are not parameters.
_CORE_TYPES = frozenset((
    "str", "int", "float", "bool", "bytes", "list", "dict", "tuple", "set", "none", "literal",
    "nullable", "union", "model", "constrained-int", "constrained-float", "constrained-str",
    "function-after", "function-before", "function-wrap", "function-plain", "json-or-python",
    "lax-or-strict", "is-instance",
))  # fmt: skip
_TAG = re.compile(r"([a-z-]+)(\[.*\])?")


def _is_union_tag(part: str) -> bool:
    match = _TAG.fullmatch(part)
    return bool(match and match.group(1) in _CORE_TYPES) or part[:1].isupper()


def location_param(location: tuple) -> str | None:
    """``("body", "messages", 0, "content")`` -> ``messages[0].content``."""
    param = ""
    for part in location:
        if isinstance(part, int):
            param += f"[{part}]"
        elif part != "body" and not _is_union_tag(part):
            param += f".{part}" if param else part
    return param or None


def _mismatch(error: dict) -> bool:
    kind = error.get("type", "")
    return kind.endswith(("_type", "_parsing")) or kind in ("missing", "model_attributes_type")


def most_telling(errors: list[dict]) -> dict:
    """The error to report: for a value tried against each member of a union, the member whose
    type fitted (a bound broken) over those it did not fit; then the deepest location."""
    best = errors[0]
    for error in errors[1:]:
        better_kind = _mismatch(best) and not _mismatch(error)
        same_kind = _mismatch(best) == _mismatch(error)
        if better_kind or (same_kind and len(error.get("loc", ())) > len(best.get("loc", ()))):
            best = error
    return best
