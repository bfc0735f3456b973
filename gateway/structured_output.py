"""OpenAI's ``response_format`` and vLLM's ``guided_*`` / ``structured_outputs`` request fields ->
the gRPC API's ``structured_output`` (a dict in its JSON form), and the names its errors take.

At most one constraint per request: two (say ``response_format`` json_schema and
``guided_regex``) are a 400 naming the second, never one silently winning.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from llmrpc.gateway.errors import invalid
from llmrpc.gateway.request_fields import StrictModel


class ResponseFormat(StrictModel):
    type: str
    json_schema: dict[str, Any] | None = None  # {"name", "schema", "strict", "description"}
    structural_tag: Any = None  # vLLM's structural_tag form (also "format" in newer ones)
    format: Any = None


class StructuredOutputs(StrictModel):
    """vLLM's ``structured_outputs`` field: one constraint and its JSON options."""

    model_config = ConfigDict(populate_by_name=True)

    # "json" on the wire; a field named so would shadow BaseModel.json
    json_schema: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict[str, Any] | None = None
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None


class StructuredFields(BaseModel):
    """The request fields that constrain the output's form (chat and completions)."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


def _schema(value: dict | str, param: str) -> dict:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise invalid(param, f"{param}: not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise invalid(param, f"{param}: a JSON schema must be an object")
    return value


def _tag(value) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _from_response_format(fmt: ResponseFormat) -> tuple[str, dict] | None:
    if fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return "response_format", {"json_object": True}
    if fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise invalid("response_format.json_schema", "json_schema needs its json_schema")
        schema = fmt.json_schema.get("schema", fmt.json_schema.get("json_schema"))
        if schema is None:  # OpenAI: a missing schema is any JSON object
            return "response_format.json_schema", {"json_object": True}
        param = "response_format.json_schema.schema"
        return param, {"json_schema": _schema(schema, param)}
    if fmt.type == "structural_tag":
        tag = fmt.format if fmt.format is not None else fmt.structural_tag
        if tag is None:
            raise invalid("response_format", "a structural_tag response_format needs its format")
        return "response_format", {"structural_tag": _tag(tag)}
    raise invalid(
        "response_format.type",
        f"response_format.type {fmt.type!r} is not one of text, json_object, json_schema, "
        "structural_tag",
    )


def _from_structured_outputs(spec: StructuredOutputs) -> list[tuple[str, dict]]:
    found = []
    if spec.json_schema is not None:
        param = "structured_outputs.json"
        found.append((param, {"json_schema": _schema(spec.json_schema, param)}))
    if spec.regex is not None:
        found.append(("structured_outputs.regex", {"regex": spec.regex}))
    if spec.choice is not None:
        found.append(("structured_outputs.choice", {"choice": {"choices": spec.choice}}))
    if spec.grammar is not None:
        found.append(("structured_outputs.grammar", {"grammar": spec.grammar}))
    if spec.json_object:
        found.append(("structured_outputs.json_object", {"json_object": True}))
    if spec.structural_tag is not None:
        tag = {"structural_tag": _tag(spec.structural_tag)}
        found.append(("structured_outputs.structural_tag", tag))
    return found


def _from_guided(body: StructuredFields) -> list[tuple[str, dict]]:
    found = []
    if body.guided_json is not None:
        found.append(("guided_json", {"json_schema": _schema(body.guided_json, "guided_json")}))
    if body.guided_regex is not None:
        found.append(("guided_regex", {"regex": body.guided_regex}))
    if body.guided_choice is not None:
        found.append(("guided_choice", {"choice": {"choices": body.guided_choice}}))
    if body.guided_grammar is not None:
        found.append(("guided_grammar", {"grammar": body.guided_grammar}))
    return found


_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "structural_tag")


def structured_output(body: StructuredFields) -> tuple[dict | None, dict[str, str]]:
    """The request's ``structured_output`` (None: free text) and the gRPC field paths of its
    errors -> the request's own parameter (for ``errors.from_grpc``)."""
    found = []
    if body.response_format is not None:
        found.extend(filter(None, [_from_response_format(body.response_format)]))
    if body.structured_outputs is not None:
        found.extend(_from_structured_outputs(body.structured_outputs))
    found.extend(_from_guided(body))
    if len(found) > 1:
        raise invalid(
            found[1][0],
            f"{found[1][0]} and {found[0][0]} both constrain the output; give one of them",
        )
    if not found:
        if body.structured_outputs is not None and _has_options(body.structured_outputs):
            raise invalid("structured_outputs", "JSON options need a constraint to apply to")
        return None, {}
    param, spec = found[0]
    options = body.structured_outputs
    for name in ("disable_any_whitespace", "disable_additional_properties"):
        value = getattr(options, name) if options is not None else None
        if value is not None:
            spec[name] = value
    kind = next(k for k in _KINDS if k in spec)
    names = {f"structured_output.{kind}": param, "structured_output": param}
    if kind == "choice":  # structured_output.choice.choices[2] -> guided_choice[2]
        names["structured_output.choice.choices"] = param
    return spec, names


def _has_options(spec: StructuredOutputs) -> bool:
    return spec.disable_any_whitespace is not None or spec.disable_additional_properties is not None
