"""Bounds on the shape of a JSON request body, checked in one walk before any validation.

Validating costs per key and per value (an unknown parameter is an error of its own, a
``logit_bias`` entry a conversion of its own), so a body of a million keys cost 14 s of the
GIL before these bounds. No request needs more than:

- ``MAX_OBJECT_KEYS`` (4,096) keys in one JSON object (OpenAI allows 5,000 properties in a whole
  structured-output schema, its largest objects);
- ``MAX_LOGIT_BIAS`` (1,024) ``logit_bias`` entries, the server's own bound (OpenAI: 300);
- ``MAX_DEPTH`` (64) levels of nesting (OpenAI allows 10 levels of schema, two JSON levels each);
- when given, ``max_items`` items in one list (the model's context length or vocabulary size).

Past one, a 400 naming the parameter that holds the object or list (``None``: the body itself).
The walk costs a few tens of nanoseconds per container element and builds a parameter's path
only for the one it reports, so its cost is linear in the body whatever its depth.
"""

from __future__ import annotations

import re

MAX_OBJECT_KEYS = 4096
MAX_LOGIT_BIAS = 1024  # as the server (engine/request.py)
MAX_DEPTH = 64
# Top-level parameters with a tighter bound on their entries than any object's.
_ENTRY_BOUNDS = {"logit_bias": MAX_LOGIT_BIAS}

# In a parsed string: surrogate pairs became one character, so any half left is a lone one.
LONE_SURROGATE = re.compile("[\ud800-\udfff]")
_NESTED = (dict, list)


class NotJson(float):
    """What the parser made of ``NaN``/``Infinity``; refused by ``first_problem``."""

    def __new__(cls, name: str) -> NotJson:
        value = super().__new__(cls, name)
        value.name = name
        return value


def param_path(link) -> str | None:
    """``messages[0].content`` for a link (parent link, key or index)."""
    parts = []
    while link is not None:
        link, step = link
        parts.append(f"[{step}]" if isinstance(step, int) else f".{step}")
    return "".join(reversed(parts)).removeprefix(".") or None


def first_problem(document, max_items: int | None = None, check_values: bool = False):
    """(parameter, what is wrong) for the first value past a bound; None if none. The shape's
    bounds name the top-level parameter holding the culprit; ``check_values`` (the raw body
    showed lone surrogates or non-finite numbers could be there) also refuses those, naming
    the value's full path, in document order."""
    if isinstance(document, dict):
        found = _object_problem(document, None)
        parts = document.items()
    else:
        found, parts = _shape_problem(None, [document], max_items), ()
    for name, value in parts:
        if found is not None:
            break
        if type(value) is dict and name in _ENTRY_BOUNDS and len(value) > _ENTRY_BOUNDS[name]:
            found = name, f"{name}: at most {_ENTRY_BOUNDS[name]} entries, got {len(value)}"
        elif type(value) in _NESTED:
            found = _shape_problem(name, [value], max_items, depth=1)
    if found is None and check_values:
        found = _value_problem(document)
    return found


def _object_problem(value: dict, name: str | None):
    if len(value) <= MAX_OBJECT_KEYS:
        return None
    where = f"{name}: an object in it" if name else "the body"
    return name, f"{where} has {len(value)} keys; at most {MAX_OBJECT_KEYS} in one JSON object"


def _shape_problem(name: str | None, level: list, max_items: int | None, depth: int = 0):
    """Breadth first, a level of containers at a time: a few tens of nanoseconds a container
    (a walk that kept each one's path cost 1.4 us: 0.5 s for a megabyte of ``[]``)."""
    while level:
        if depth >= MAX_DEPTH:
            return name, f"{name or 'the body'} is nested deeper than {MAX_DEPTH} levels"
        below = []
        for value in level:
            if type(value) is dict:
                if len(value) > MAX_OBJECT_KEYS:
                    return _object_problem(value, name)
                below += [item for item in value.values() if type(item) in _NESTED]
            else:
                if max_items is not None and len(value) > max_items:
                    return name, (
                        f"{name or 'the body'} has a list of {len(value)} items; at most "
                        f"{max_items} can be served (the model's context length or vocabulary "
                        "size)"
                    )
                below += [item for item in value if type(item) in _NESTED]
        level, depth = below, depth + 1
    return None


def _value_problem(document):
    """The first lone surrogate or non-finite number, in document order, with its path. The
    paths are links (parent, step), turned into text only for the one reported."""
    stack = [(document, None)]
    while stack:
        value, link = stack.pop()
        if isinstance(value, str):
            if LONE_SURROGATE.search(value):
                return _at(link, "contains a lone UTF-16 surrogate escape, which is no character")
        elif isinstance(value, NotJson):
            return _at(link, f"{value.name} is not a JSON number: numbers must be finite")
        elif isinstance(value, list):
            stack += reversed([(item, (link, i)) for i, item in enumerate(value)])
        elif isinstance(value, dict):
            if any(LONE_SURROGATE.search(key) for key in value):
                return _at(link, "has a key with a lone UTF-16 surrogate escape")
            stack += reversed([(item, (link, key)) for key, item in value.items()])
    return None


def _at(link, what: str) -> tuple[str | None, str]:
    param = param_path(link)
    return param, f"{param}: {what}" if param else f"the body {what}"
