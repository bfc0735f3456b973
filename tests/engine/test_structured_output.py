"""Structured output on the engine, with a random-weight model: its free output is noise, so
every output that validates was made to by the grammar.

One engine per backend for the module; each test runs its requests in one batch, mixing
constrained and free ones.
"""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest
from engine_utils import make_core, run_to_completion

from llmrpc.engine.request import (
    DEFAULT_MAX_JSON_WHITESPACE,
    FinishReason,
    InvalidRequestError,
    SamplingParams,
    StructuredOutputSpec,
)
from llmrpc.engine.structured_output import grammar as structured_output
from llmrpc.engine.structured_output.step import allocate_bitmask, bitmask_to_bool

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "pet": {"enum": ["cat", "dog", None]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
}


@pytest.fixture(scope="module")
def core(tiny_llama_dir):
    return make_core(tiny_llama_dir)


def _params(spec: StructuredOutputSpec | None, seed: int, **fields) -> SamplingParams:
    fields.setdefault("max_tokens", 160)
    return SamplingParams(seed=seed, structured_output=spec, **fields)


def _run(core, params: list[SamplingParams], prompt=(1, 2, 3)) -> list:
    requests = {f"r{i}": (list(prompt), p) for i, p in enumerate(params)}
    outputs = run_to_completion(core, requests)
    return [outputs[f"r{i}"] for i in range(len(params))]


def _json_spec(**options) -> StructuredOutputSpec:
    return StructuredOutputSpec("json_schema", json.dumps(SCHEMA), **options)


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_fifty_seeded_samples_all_validate_in_a_mixed_batch(core, backend):
    options = {"any_whitespace": False, "additional_properties": False}
    spec = structured_output.check(_json_spec(**options), backend)
    constrained = [_params(spec, seed) for seed in range(50)]
    free = [_params(None, seed, max_tokens=20) for seed in range(6)]
    outputs = _run(core, constrained + free)
    for output in outputs[:50]:
        assert output.finish_reason is FinishReason.EOS, output.text
        jsonschema.validate(json.loads(output.text), SCHEMA)
    texts = [output.text for output in outputs[50:]]
    assert all(output.finish_reason is FinishReason.LENGTH for output in outputs[50:])
    assert sum(_parses(text) for text in texts) == 0, "free output of noise parsed as JSON"


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_regex_and_choice_always_match(core, backend):
    regex = r"(red|green|blue)-[0-9]{2,4}"
    choices = ("yes", 'a "quoted" one', "línea\nnueva")
    regex_spec = structured_output.check(StructuredOutputSpec("regex", regex), backend)
    choice_spec = structured_output.check(StructuredOutputSpec("choice", choices=choices), backend)
    params = [_params(regex_spec, s) for s in range(10)] + [
        _params(choice_spec, s) for s in range(10)
    ]
    outputs = _run(core, params)
    for output in outputs[:10]:
        assert re.fullmatch(regex, output.text), output.text
    assert {output.text for output in outputs[10:]} <= set(choices)


def test_ebnf_grammar_output_parses(core):
    grammar = 'root ::= expr\nexpr ::= term ("+" term)*\nterm ::= [0-9] | "(" expr ")"'
    spec = structured_output.check(StructuredOutputSpec("grammar", grammar), "auto")
    assert spec.backend == "xgrammar"
    outputs = _run(core, [_params(spec, s, max_tokens=40) for s in range(8)])
    complete = [output for output in outputs if output.finish_reason is FinishReason.EOS]
    assert complete, "no output completed its expression"
    for output in outputs:  # a cut one is still a prefix: the grammar's characters alone
        assert re.fullmatch(r"[0-9()+]*", output.text), output.text
    for output in complete:
        eval(output.text, {"__builtins__": {}})  # digits, + and parentheses only: it parses


def test_a_lark_grammar_falls_back_to_guidance_unless_fallback_is_off():
    lark = 'start: "a" b\nb: "b"+'
    spec = structured_output.check(StructuredOutputSpec("grammar", lark), "auto")
    assert spec.backend == "guidance"
    with pytest.raises(InvalidRequestError) as error:
        structured_output.check(StructuredOutputSpec("grammar", lark), "auto", fallback=False)
    assert error.value.field == "structured_output.grammar"


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        (
            StructuredOutputSpec("json_schema", '{"type": "nonsense"}'),
            "structured_output.json_schema",
        ),
        (StructuredOutputSpec("regex", "a(b"), "structured_output.regex"),
        (StructuredOutputSpec("grammar", "root ::= "), "structured_output.grammar"),
        (StructuredOutputSpec("choice", choices=()), "structured_output.choice.choices"),
        (StructuredOutputSpec("choice", choices=("a", "")), "structured_output.choice.choices"),
        (StructuredOutputSpec("regex", "a" * 300_000), "structured_output.regex"),
    ],
)
def test_bad_constraints_name_their_field(spec, field):
    with pytest.raises(InvalidRequestError) as error:
        structured_output.check(spec, "auto")
    assert error.value.field == field


def test_n_samples_each_keep_their_own_matcher(core):
    spec = structured_output.check(_json_spec(any_whitespace=False), "xgrammar")
    core.add_request(
        "n", [5, 6, 7], SamplingParams(n=4, seed=3, max_tokens=160, structured_output=spec)
    )
    texts = {}
    while core.has_unfinished_requests:
        for output in core.step():
            texts[output.index] = texts.get(output.index, "") + output.text
    assert len(set(texts.values())) == 4
    for text in texts.values():
        jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_json_object_builds_on_both_backends(backend):
    spec = structured_output.check(StructuredOutputSpec("json_object"), backend)
    assert spec.backend == backend


def test_the_grammar_waits_for_the_end_of_reasoning(core):
    # A one-token end of reasoning, pushed by a bias: the output is free until it, then held
    # to the choice (the bias cannot push it again: the grammar has no room for it).
    (end,) = core.tokenizer.encode(" Paris", add_special_tokens=False)
    spec = structured_output.check(
        StructuredOutputSpec("choice", choices=("yes", "no"), reasoning_end=(end,)), "xgrammar"
    )
    ended = _params(spec, 0, max_tokens=30, logit_bias={end: 100.0})
    never_ends = _params(spec, 1, max_tokens=30, bad_words=["Paris"])
    outputs = _run(core, [ended, never_ends])
    assert outputs[0].finish_reason is FinishReason.EOS
    assert outputs[0].token_ids[0] == end
    assert outputs[0].text in (" Parisyes", " Parisno")
    assert outputs[1].finish_reason is FinishReason.LENGTH


def test_a_compiling_grammar_holds_up_no_other_request_and_can_be_aborted(core, monkeypatch):
    release = threading.Event()
    build = core.grammar_compiler._build

    def blocked_build(spec):  # the compile goes on until release is set
        release.wait(60)
        return build(spec)

    monkeypatch.setattr(core.grammar_compiler, "_build", blocked_build)
    spec = structured_output.check(StructuredOutputSpec("regex", "[ab]{3}"), "xgrammar")
    core.add_request("held", [1, 2], _params(spec, 0))
    core.add_request("aborted", [1, 2], _params(spec, 1))
    core.add_request("free", [1, 2], _params(None, 2, max_tokens=5))
    assert core.stats.num_waiting == 3
    outputs = {}
    while "free" not in outputs or not outputs["free"].finished:
        for output in core.step():
            outputs[output.request_id] = output
    assert set(outputs) == {"free"}, "a request under a compiling grammar was computed"
    (aborted,) = core.abort_requests(["aborted"])
    assert aborted.finish_reason is FinishReason.ABORT
    release.set()
    texts = ""
    while core.has_unfinished_requests:
        texts += "".join(output.text for output in core.step())
    assert re.fullmatch("[ab]{3}", texts)
    assert core.kv_manager.num_free_blocks == core.kv_manager.num_blocks


def test_preempted_constrained_requests_resume_their_grammar(tiny_llama_dir, core):
    # 12 blocks of 16 tokens hold about 3 of the 16 requests at full length: most are
    # recomputed at least once, their matchers kept where their outputs stand.
    spec = structured_output.check(_json_spec(any_whitespace=False), "xgrammar")
    params = [_params(spec, seed, max_tokens=60) for seed in range(16)]
    expected = _run(core, params)
    tight = make_core(tiny_llama_dir, num_blocks=12, max_model_len=128, max_num_batched_tokens=64)
    preempted = set()
    schedule = tight.scheduler.schedule

    def spying_schedule():
        output = schedule()
        preempted.update(r.request_id for r in output.preempted)
        return output

    tight.scheduler.schedule = spying_schedule
    outputs = _run(tight, params)
    assert len(preempted) >= 4
    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]


def test_a_structural_tag_holds_its_spans(core):
    # a tag whose content is a regex (JSON content would allow whitespace without end)
    tag = {
        "type": "structural_tag",
        "format": {
            "type": "tag",
            "begin": "<call>",
            "content": {"type": "regex", "pattern": "[a-z]{1,8}=[0-9]{1,3}"},
            "end": "</call>",
        },
    }
    spec = structured_output.check(StructuredOutputSpec("structural_tag", json.dumps(tag)), "auto")
    assert spec.backend == "xgrammar"
    for output in _run(core, [_params(spec, seed, max_tokens=40) for seed in range(4)]):
        assert re.fullmatch(r"<call>[a-z]{1,8}=[0-9]{1,3}</call>", output.text), output.text


def test_the_first_token_may_open_reasoning_or_begin_the_answer(core):
    # reasoning_start: a first token that opens reasoning (up to reasoning_end); any other
    # first token begins the answer, held from there.
    (start,) = core.tokenizer.encode(" London", add_special_tokens=False)
    (end,) = core.tokenizer.encode(" Paris", add_special_tokens=False)
    spec = StructuredOutputSpec(
        "choice", choices=("yes", "no"), reasoning_end=(end,), reasoning_start=start
    )
    spec = structured_output.check(spec, "xgrammar")
    thinks = _params(spec, 0, max_tokens=40, logit_bias={start: 100.0, end: 100.0})
    answers = [_params(spec, seed, max_tokens=40) for seed in range(1, 5)]
    outputs = _run(core, [thinks, *answers])
    assert outputs[0].token_ids[0] == start and outputs[0].finish_reason is FinishReason.EOS
    assert end in outputs[0].token_ids and outputs[0].text.endswith(("yes", "no"))
    for output in outputs[1:]:
        assert output.text in ("yes", "no")


def _allows(core, grammar: structured_output.Grammar, token_id: int) -> bool:
    """Whether the grammar's token mask lets ``token_id`` be sampled next."""
    bitmask = allocate_bitmask(1, core.hf_config.vocab_size)
    grammar.fill(bitmask, 0)
    return bool(bitmask_to_bool(bitmask, core.hf_config.vocab_size)[0, token_id])


def _whitespace_grammar(core, backend: str, **options) -> structured_output.Grammar:
    spec = StructuredOutputSpec("json_schema", json.dumps(SCHEMA), **options)
    compiled = core.grammar_compiler.submit(spec, backend)
    compiled.result(timeout=120)
    grammar = structured_output.Grammar(spec, compiled, core.eos_token_ids)
    prefix = core.tokenizer.encode('{"name":', add_special_tokens=False)
    for end in range(1, len(prefix) + 1):
        assert grammar.accept(prefix[:end]) is None
    return grammar


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_json_whitespace_runs_are_bounded_by_default(core, backend):
    # A seeded sample of the packaged model once spent its whole budget on tabs after a key:
    # by default a run of whitespace between JSON tokens is at most DEFAULT_MAX_JSON_WHITESPACE.
    grammar = _whitespace_grammar(core, backend)
    tab, space, newline = (core.tokenizer.encode(c, add_special_tokens=False)[0] for c in "\t \n")
    output = []
    for _ in range(DEFAULT_MAX_JSON_WHITESPACE):
        assert _allows(core, grammar, tab)
        output.append(tab)
        assert grammar.accept(output) is None
    assert not any(_allows(core, grammar, token) for token in (tab, space, newline))
    quote = core.tokenizer.encode('"', add_special_tokens=False)[0]
    assert _allows(core, grammar, quote), "the value can still begin"


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_the_whitespace_bound_can_be_set_or_lifted(core, backend):
    (tab,) = core.tokenizer.encode("\t", add_special_tokens=False)
    for bound, expected in ((2, 2), (None, 40)):
        grammar = _whitespace_grammar(core, backend, max_whitespace=bound)
        output = []
        while len(output) < 40 and _allows(core, grammar, tab):
            output.append(tab)
            assert grammar.accept(output) is None
        assert len(output) == expected, bound


@pytest.mark.parametrize(
    ("schema", "keyword"),
    [
        ({"not": {"type": "integer"}}, "not"),
        ({"type": "object", "properties": {"a": {"if": {}, "then": {}}}}, "if"),
        ({"anyOf": [{"type": "string"}, {"allOf": [{"minimum": 1}, {"maximum": 3}]}]}, "allOf"),
        ({"items": [{"else": {}}]}, "else"),
        ({"$defs": {"a": {"not": {}}}, "$ref": "#/$defs/a"}, "not"),
        # names and data are not keywords: a property called "not", an enum of "if"
        ({"type": "object", "properties": {"not": {"type": "string"}}}, None),
        ({"enum": [{"not": 1}], "default": {"if": 2}}, None),
        ({"allOf": [{"type": "integer", "minimum": 5}]}, None),
    ],
)
def test_keywords_xgrammar_would_ignore_are_found(schema, keyword):
    assert structured_output.unenforced_by_xgrammar(schema) == keyword
