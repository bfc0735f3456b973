"""How often seeded samples of the packaged model under a JSON schema end as valid JSON.

Not part of ``make test`` (it samples the real model for minutes). For each of three schemas,
``--samples`` seeded requests (temperature 1, ``--max-tokens`` each) run in one batch on the
engine core; the script prints, per schema and in all, how many stopped on their own (EOS), how
many of those parse and validate, and the longest whitespace run between JSON tokens, as JSON.

    .venv/bin/python tests/structured/measure_json_validity.py                # today's default
    .venv/bin/python tests/structured/measure_json_validity.py --max-whitespace none  # unbounded
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import time

import jsonschema

from llmrpc.engine.config import EngineConfig, ModelConfig
from llmrpc.engine.core.engine_core import EngineCore
from llmrpc.engine.request import FinishReason, SamplingParams, StructuredOutputSpec

SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer"},
            "email": {"type": "string"},
        },
        "required": ["name", "age", "email"],
    },
    "city": {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "country": {"type": "string"},
            "population": {"type": "integer"},
            "capital": {"type": "boolean"},
        },
        "required": ["city", "country", "population", "capital"],
    },
    "order": {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "items": {  # unbounded, about half the samples list items past 128 tokens
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "maxLength": 12},
                        "qty": {"type": "integer"},
                    },
                    "required": ["sku", "qty"],
                },
                "maxItems": 3,
            },
            "paid": {"type": "boolean"},
        },
        "required": ["id", "items", "paid"],
    },
}

PROMPTS = {
    "person": "Describe a person (name, age, email) as JSON.",
    "city": "Describe a city (city, country, population, capital) as JSON.",
    "order": "Write an online shop order (id, items with sku and qty, paid) as JSON.",
}


def _max_whitespace(text: str) -> int | None:
    return None if text.lower() == "none" else int(text)


def _spec(schema: dict, max_whitespace: str) -> StructuredOutputSpec:
    spec = StructuredOutputSpec("json_schema", json.dumps(schema))
    if max_whitespace != "default":  # a build without the option still measures "none"
        spec = StructuredOutputSpec(
            "json_schema", json.dumps(schema), max_whitespace=_max_whitespace(max_whitespace)
        )
    return spec


def _valid(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def _longest_whitespace(text: str) -> int:
    return max((len(run) for run in re.findall(r"[ \t\n\r]+", text)), default=0)


def measure(core: EngineCore, name: str, args) -> dict:
    schema = SCHEMAS[name]
    messages = [{"role": "user", "content": PROMPTS[name]}]
    text = core.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt = core.tokenizer.encode(text, add_special_tokens=False)
    spec = _spec(schema, args.max_whitespace)
    for seed in range(args.samples):
        params = SamplingParams(seed=seed, max_tokens=args.max_tokens, structured_output=spec)
        core.add_request(f"{name}-{seed}", list(prompt), params)
    texts, reasons = {}, {}
    started = time.monotonic()
    while core.has_unfinished_requests:
        for output in core.step():
            texts[output.request_id] = texts.get(output.request_id, "") + output.text
            if output.finished:
                reasons[output.request_id] = output.finish_reason
    stopped = [rid for rid, reason in reasons.items() if reason is FinishReason.EOS]
    return {
        "samples": args.samples,
        "stopped_on_their_own": len(stopped),
        "stopped_and_valid": sum(_valid(texts[rid], schema) for rid in stopped),
        "valid": sum(_valid(text, schema) for text in texts.values()),
        "longest_whitespace_run": max(map(_longest_whitespace, texts.values()), default=0),
        "seconds": round(time.monotonic() - started, 1),
        "not_stopped_examples": [texts[rid] for rid in sorted(set(texts) - set(stopped))][
            : args.show
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument(
        "--max-whitespace", default="default", help="N, none (unbounded) or default"
    )
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--show", type=int, default=0, help="outputs shown that did not stop")
    parser.add_argument("--schemas", nargs="+", default=list(SCHEMAS), choices=list(SCHEMAS))
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    core = EngineCore(EngineConfig(model=ModelConfig(dtype=args.dtype)))
    results = {name: measure(core, name, args) for name in args.schemas}
    total = {
        key: sum(result[key] for result in results.values())
        for key in ("samples", "stopped_on_their_own", "stopped_and_valid", "valid")
    }
    print(json.dumps({"max_whitespace": args.max_whitespace, **results, "all": total}, indent=2))


if __name__ == "__main__":
    main()
