"""Structured output through the gRPC API, with the engine core in a process of its own (the
constraint crosses to it with the request): a random-weight model's output held to a schema,
a regex and a choice; bad constraints are INVALID_ARGUMENT naming their field, before any work
is queued."""

from __future__ import annotations

import json
import re

import grpc
import jsonschema
import pytest
from google.protobuf import json_format
from server_utils import field_violations
from transformers import AutoTokenizer

from llmrpc.engine.request import StructuredOutputSpec
from llmrpc.server.reasoning_parsers import get_reasoning_parser
from llmrpc.server.structured_output import after_reasoning
from llmrpc.v1 import common_pb2, generation_pb2

pytestmark = pytest.mark.asyncio(loop_scope="module")

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "population": {"type": "integer", "minimum": 0, "maximum": 99999},
        "capital": {"type": "boolean"},
    },
    "required": ["city", "population", "capital"],
}


@pytest.fixture(scope="module")
def engine_mode() -> str:
    return "process"


def request(structured: dict, seed: int = 0, **fields) -> generation_pb2.GenerateRequest:
    message = generation_pb2.GenerateRequest(
        text="Give me a city as JSON:",
        sampling=common_pb2.SamplingParams(temperature=1.0, seed=seed),
        stopping=common_pb2.StoppingCriteria(max_tokens=120),
        **fields,
    )
    if isinstance(structured.get("json_schema"), dict):
        structured = {**structured, "json_schema": json.dumps(structured["json_schema"])}
    json_format.ParseDict(structured, message.structured_output)
    return message


async def test_json_schema_outputs_validate_streamed_and_unary(generation):
    structured = {"json_schema": SCHEMA, "disable_any_whitespace": True}
    for seed in range(6):
        response = await generation.Generate(request(structured, seed))
        assert response.finish_reason == generation_pb2.FINISH_REASON_EOS, response.text
        jsonschema.validate(json.loads(response.text), SCHEMA)
    streamed = [m async for m in generation.GenerateStream(request(structured, 0))]
    unary = await generation.Generate(request(structured, 0))
    assert "".join(m.text for m in streamed) == unary.text


async def test_regex_and_choice_hold_beside_a_free_request(generation):
    free = generation.Generate(
        generation_pb2.GenerateRequest(
            text="Free text",
            stopping=common_pb2.StoppingCriteria(max_tokens=30, ignore_eos=True),
        )
    )
    regex = generation.Generate(request({"regex": r"[A-Z][a-z]{2,5} [0-9]{1,3}"}, 1))
    choice = generation.Generate(request({"choice": {"choices": ["left", "right"]}}, 2))
    free, regex, choice = await free, await regex, await choice
    assert free.usage.completion_tokens == 30
    assert re.fullmatch(r"[A-Z][a-z]{2,5} [0-9]{1,3}", regex.text)
    assert choice.text in ("left", "right")


@pytest.mark.parametrize(
    ("structured", "field"),
    [
        ({"json_schema": {"type": "no-such-type"}}, "structured_output.json_schema"),
        ({"json_schema": '{"type": '}, "structured_output.json_schema"),
        ({"regex": "(unclosed"}, "structured_output.regex"),
        ({"grammar": "root ::= ("}, "structured_output.grammar"),
        ({"choice": {"choices": []}}, "structured_output.choice.choices"),
        ({"json_object": False}, "structured_output.json_object"),
        ({"disable_any_whitespace": True}, "structured_output"),
    ],
)
async def test_a_bad_constraint_is_invalid_argument_naming_its_field(generation, structured, field):
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        await generation.Generate(request(structured))
    assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field_violations(failure.value) == [field]


@pytest.mark.parametrize(
    ("parser", "prompt_tail", "expected"),
    [
        ("qwen3", "", "either"),  # the first token may open reasoning
        ("qwen3", "<think>", "reasoning"),  # the template opened it
        ("qwen3", "<think>\n\n</think>\n\n", "answer"),  # thinking turned off
        ("deepseek_r1", "", "reasoning"),  # the output starts in reasoning
        ("deepseek_r1", "<think>a</think>", "answer"),
    ],
)
async def test_a_reasoning_parser_holds_the_answer_alone(
    tiny_llama_dir, parser, prompt_tail, expected
):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    prompt = tokenizer.encode("<|im_start|>assistant\n" + prompt_tail)
    spec = after_reasoning(
        StructuredOutputSpec("regex", "a+"), prompt, tokenizer, get_reasoning_parser(parser)
    )
    close = tuple(tokenizer.convert_tokens_to_ids(["</think>"]))
    if expected == "answer":
        assert spec.reasoning_end == () and spec.reasoning_start is None
    else:
        assert spec.reasoning_end == close
        opens = spec.reasoning_start == tokenizer.convert_tokens_to_ids("<think>")
        assert opens == (expected == "either")
