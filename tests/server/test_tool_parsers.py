"""Tool-call parsers: scripted outputs of each format read as exact calls and content; streaming
any split of an output gives what the whole parse gives; malformed calls stay content; plugins."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmrpc.server import tool_parsers
from llmrpc.server.tool_parsers import (
    ContentDelta,
    FunctionDelta,
    ParsedOutput,
    ToolCallDelta,
    ToolParser,
    get_tool_parser,
    load_tool_parser_plugin,
    register_tool_parser,
    tool_parser_names,
)

SETTINGS = settings(max_examples=40, deadline=None, database=None, derandomize=True)


@dataclass(frozen=True)
class Case:
    id: str
    parser: str
    text: str
    content: str | None
    calls: tuple[tuple[str, str], ...] = ()


PARIS = ("get_weather", '{"city": "Paris"}')

HERMES = [
    Case(
        "single",
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        None,
        (PARIS,),
    ),
    Case(
        "several-text-around",
        "hermes",
        'I will look both up.\n<tool_call>{"name":"a","arguments":{"x":1}}</tool_call>\n'
        '<tool_call>{"name": "b", "arguments": {"y": [1, 2]}}</tool_call>\nDone.',
        "I will look both up.\n\n\nDone.",
        (("a", '{"x": 1}'), ("b", '{"y": [1, 2]}')),
    ),
    Case(
        "nested",
        "hermes",
        '<tool_call>{"name": "q", "arguments": {"f": {"r": {"min": 1, "max": [2, {"d": null}]}},'
        ' "ok": true}}</tool_call>',
        None,
        (("q", '{"f": {"r": {"min": 1, "max": [2, {"d": null}]}}, "ok": true}'),),
    ),
    Case(
        "unicode",
        "hermes",
        'Météo 🌧 :<tool_call>{"name": "météo", "arguments": {"ville": "Z\\u00fcrich",'
        ' "note": "東京"}}</tool_call>',
        "Météo 🌧 :",
        (("météo", '{"ville": "Zürich", "note": "東京"}'),),
    ),
    Case(
        "empty-arguments",
        "hermes",
        '<tool_call>{"name": "now", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "today"}</tool_call>',
        None,
        (("now", "{}"), ("today", "{}")),
    ),
    Case(
        "double-encoded-arguments",
        "hermes",
        '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>',
        None,
        (("f", '{"a": 1}'),),
    ),
    Case("plain-text", "hermes", "a < b, and <tool> is no tag", "a < b, and <tool> is no tag"),
    Case(
        "bad-json",
        "hermes",
        '<tool_call>{"name": "f", "arguments": {"x": }}</tool_call>',
        '<tool_call>{"name": "f", "arguments": {"x": }}</tool_call>',
    ),
    Case(
        "unclosed",
        "hermes",
        'Hi <tool_call>{"name": "f", "arguments": {}}',
        'Hi <tool_call>{"name": "f", "arguments": {}}',
    ),
    Case(
        "no-name-then-good",
        "hermes",
        '<tool_call>{"arguments": {}}</tool_call> <tool_call>{"name": "g"}</tool_call>',
        '<tool_call>{"arguments": {}}</tool_call> ',
        (("g", "{}"),),
    ),
    Case(
        "non-object-arguments-and-nan",
        "hermes",
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>'
        '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>',
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>'
        '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>',
    ),
    Case(
        "whitespace-only-content",
        "hermes",
        ' \n<tool_call>{"name": "a"}</tool_call>\n\n',
        None,
        (("a", "{}"),),
    ),
]

LLAMA3 = [
    Case(
        "single",
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        None,
        (PARIS,),
    ),
    Case(
        "python-tag-several",
        "llama3_json",
        '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": {"y":'
        ' "z"}};{"name": "c", "parameters": {}}',
        None,
        (("a", '{"x": 1}'), ("b", '{"y": "z"}'), ("c", "{}")),
    ),
    Case(
        "text-before-and-after",
        "llama3_json",
        'Let me call it.<|python_tag|>{"name": "a", "parameters": {"n": {"m": [true, 1.5]}}}\nok',
        "Let me call it.\nok",
        (("a", '{"n": {"m": [true, 1.5]}}'),),
    ),
    Case(
        "unicode",
        "llama3_json",
        ' {"name": "traduire", "parameters": {"texte": "ça va 😀"}}',
        None,
        (("traduire", '{"texte": "ça va 😀"}'),),
    ),
    Case(
        "spaces-around-separators",
        "llama3_json",
        '{"name": "a", "parameters": {}} ;\n {"name": "b", "parameters": {"k": "v"}} \n',
        None,
        (("a", "{}"), ("b", '{"k": "v"}')),
    ),
    Case("json-answer-is-content", "llama3_json", '{"answer": 42}', '{"answer": 42}'),
    Case("no-parameters", "llama3_json", '{"name": "Bob"}', '{"name": "Bob"}'),
    Case(
        "json-not-first-is-content",
        "llama3_json",
        'Call: {"name": "a", "parameters": {}}',
        'Call: {"name": "a", "parameters": {}}',
    ),
    Case(
        "unclosed",
        "llama3_json",
        '<|python_tag|>{"name": "a", "parameters": {',
        '<|python_tag|>{"name": "a", "parameters": {',
    ),
    Case(
        "dangling-second-call",
        "llama3_json",
        '{"name": "a", "parameters": {}}; {"name": ',
        '; {"name": ',
        (("a", "{}"),),
    ),
]

MISTRAL = [
    Case(
        "single",
        "mistral",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
        None,
        (PARIS,),
    ),
    Case(
        "several-text-around",
        "mistral",
        'Sure.[TOOL_CALLS] [{"name": "a", "arguments": {"x": {"y": [1]}}}, {"name": "b",'
        ' "arguments": {}}] then',
        "Sure. then",
        (("a", '{"x": {"y": [1]}}'), ("b", "{}")),
    ),
    Case(
        "one-object-unicode",
        "mistral",
        '[TOOL_CALLS]{"name": "dire", "arguments": {"mot": "naïve ✓"}}',
        None,
        (("dire", '{"mot": "naïve ✓"}'),),
    ),
    Case(
        "name-args-form",
        "mistral",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]now[ARGS]{}',
        None,
        (PARIS, ("now", "{}")),
    ),
    Case(
        "unclosed-list",
        "mistral",
        '[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}',
        '[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}',
    ),
    Case(
        "not-json-then-a-call",
        "mistral",
        '[TOOL_CALLS] sorry [TOOL_CALLS][{"name": "a"}]',
        "[TOOL_CALLS] sorry ",
        (("a", "{}"),),
    ),
    Case(
        "item-without-name",
        "mistral",
        '[TOOL_CALLS][{"name": "a"}, {"arguments": {}}]',
        '[TOOL_CALLS][{"name": "a"}, {"arguments": {}}]',
    ),
    Case("args-not-object", "mistral", "[TOOL_CALLS]f[ARGS][1]", "[TOOL_CALLS]f[ARGS][1]"),
]

PYTHONIC = [
    Case("single", "pythonic", '[get_weather(city="Paris")]', None, (PARIS,)),
    Case(
        "several-multiline",
        "pythonic",
        "[\n  get_weather(city='Paris', days=3),\n  get_time(zone=\"Europe/Paris\")\n]",
        None,
        (("get_weather", '{"city": "Paris", "days": 3}'), ("get_time", '{"zone": "Europe/Paris"}')),
    ),
    Case(
        "nested-literals",
        "pythonic",
        '[search(filters={"tags": ["a", "b"], "range": (1, 2)}, exact=True, limit=None, s=-1.5)]',
        None,
        (
            (
                "search",
                '{"filters": {"tags": ["a", "b"], "range": [1, 2]}, "exact": true,'
                ' "limit": null, "s": -1.5}',
            ),
        ),
    ),
    Case(
        "text-around",
        "pythonic",
        'I will check.\n  [get_weather(city="Paris")]\nAnything else?',
        "I will check.\n  \nAnything else?",
        (PARIS,),
    ),
    Case(
        "brackets-in-strings",
        "pythonic",
        '[f(text="a ] b [ c", q=\'it\\\'s\', code="""x = [1]\nprint(x)""")]',
        None,
        (("f", '{"text": "a ] b [ c", "q": "it\'s", "code": "x = [1]\\nprint(x)"}'),),
    ),
    Case(
        "unicode-empty-arguments",
        "pythonic",
        '[translate(text="héllo 世界"), get_time()]',
        None,
        (("translate", '{"text": "héllo 世界"}'), ("get_time", "{}")),
    ),
    Case(
        "escapes",
        "pythonic",
        r"""[f(a='x\\', b="q\"u]", c='''t'' \''' ]''', d='\']', e='''it's ]''')]""",
        None,
        (("f", r"""{"a": "x\\", "b": "q\"u]", "c": "t'' ''' ]", "d": "']", "e": "it's ]"}"""),),
    ),
    Case(
        "comments",
        "pythonic",
        "[f(x=1),  # the first]\n g(y='#')  # ]\n]",
        None,
        (("f", '{"x": 1}'), ("g", '{"y": "#"}')),
    ),
    Case("inline-is-content", "pythonic", "See [f(x=1)] here", "See [f(x=1)] here"),
    Case("not-calls", "pythonic", "[1] first\n[note] second", "[1] first\n[note] second"),
    Case(
        "non-literal-argument",
        "pythonic",
        '[f(x=__import__("os").getcwd())]',
        '[f(x=__import__("os").getcwd())]',
    ),
    Case("positional", "pythonic", "[f(1)]", "[f(1)]"),
    Case("star-star", "pythonic", "[f(**kw)]", "[f(**kw)]"),
    Case("set-and-bytes", "pythonic", '[f(x={1, 2}), g(y=b"r")]', '[f(x={1, 2}), g(y=b"r")]'),
    Case("method", "pythonic", "[obj.run(x=1)]", "[obj.run(x=1)]"),
    Case("unclosed", "pythonic", '[f(x="a")', '[f(x="a")'),
]

QWEN3_CODER = [
    Case(
        "single-typed-values",
        "qwen3_coder",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        '<parameter=days>\n3\n</parameter>\n<parameter=opts>\n{"metric": true, "l": [1]}\n'
        '</parameter>\n<parameter=code>\n"42"\n</parameter>\n<parameter=none>\nnull\n'
        "</parameter>\n<parameter=nan>\nNaN\n</parameter>\n</function>\n</tool_call>",
        None,
        (
            (
                "get_weather",
                '{"city": "Paris", "days": 3, "opts": {"metric": true, "l": [1]}, "code": "42",'
                ' "none": null, "nan": "NaN"}',
            ),
        ),
    ),
    Case(
        "several-text-around",
        "qwen3_coder",
        "Checking.\n<tool_call>\n<function=a>\n<parameter=path>\n/tmp/ü.txt\n</parameter>\n"
        "</function>\n</tool_call>\n<tool_call><function=b><parameter=body>def f():\n"
        "    return [1]\n</parameter></function></tool_call>\nDone",
        "Checking.\n\n\nDone",
        (("a", '{"path": "/tmp/ü.txt"}'), ("b", '{"body": "def f():\\n    return [1]"}')),
    ),
    Case(
        "empty-arguments",
        "qwen3_coder",
        "<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
        None,
        (("get_time", "{}"),),
    ),
    Case(
        "no-function-end",
        "qwen3_coder",
        "<tool_call><function=a><parameter=x>1</parameter></tool_call>",
        "<tool_call><function=a><parameter=x>1</parameter></tool_call>",
    ),
    Case(
        "text-between-parameters",
        "qwen3_coder",
        "<tool_call><function=a><parameter=x>1</parameter>junk</function></tool_call>",
        "<tool_call><function=a><parameter=x>1</parameter>junk</function></tool_call>",
    ),
    Case(
        "unclosed-parameter",
        "qwen3_coder",
        "<tool_call><function=a><parameter=x>1</function></tool_call>",
        "<tool_call><function=a><parameter=x>1</function></tool_call>",
    ),
    Case(
        "unclosed-call",
        "qwen3_coder",
        "Hi\n<tool_call><function=a></function>",
        "Hi\n<tool_call><function=a></function>",
    ),
]

CASES = HERMES + LLAMA3 + MISTRAL + PYTHONIC + QWEN3_CODER


def assembled(deltas: list) -> tuple[str | None, list[tuple[str, str]]]:
    """Content and (name, arguments) per call from streamed deltas, checking OpenAI's shape."""
    content, calls = "", []
    for delta in deltas:
        if isinstance(delta, ContentDelta):
            assert delta.text, "an empty content delta"
            content += delta.text
        elif delta.id is not None:  # a call's first delta
            assert delta.index == len(calls) and delta.type == "function"
            assert delta.function.name and delta.function.arguments == ""
            calls.append([delta.function.name, ""])
        else:
            assert delta.index == len(calls) - 1 and delta.function.name is None
            assert delta.type is None and delta.function.arguments
            calls[delta.index][1] += delta.function.arguments
    return content or None, [tuple(call) for call in calls]


def streamed(parser: ToolParser, text: str, cuts: list[int]) -> list:
    stream, deltas, start = parser.stream(), [], 0
    for cut in [*sorted(cuts), len(text)]:
        deltas += stream.feed(text[start:cut])
        start = cut
    return deltas + stream.finish()


def whole(parsed: ParsedOutput) -> tuple[str | None, list[tuple[str, str]]]:
    return parsed.content, [(call.name, call.arguments) for call in parsed.tool_calls]


@pytest.mark.parametrize("case", CASES, ids=lambda case: f"{case.parser}-{case.id}")
def test_whole_output_reads_as_scripted(case: Case):
    parsed = get_tool_parser(case.parser).parse(case.text)
    assert whole(parsed) == (case.content, list(case.calls))
    for call in parsed.tool_calls:
        assert isinstance(json.loads(call.arguments), dict)
        assert call.type == "function"


@pytest.mark.parametrize("case", CASES, ids=lambda case: f"{case.parser}-{case.id}")
@SETTINGS
@given(data=st.data())
def test_streaming_any_split_gives_the_whole_parse(case: Case, data: st.DataObject):
    cuts = data.draw(st.lists(st.integers(0, len(case.text)), max_size=8))
    parser = get_tool_parser(case.parser)
    assert assembled(streamed(parser, case.text, cuts)) == (case.content, list(case.calls))


@pytest.mark.parametrize("case", CASES, ids=lambda case: f"{case.parser}-{case.id}")
def test_streaming_one_character_at_a_time(case: Case):
    parser = get_tool_parser(case.parser)
    cuts = list(range(len(case.text)))
    assert assembled(streamed(parser, case.text, cuts)) == (case.content, list(case.calls))


# Pieces of every format, well-formed and not, for outputs no one scripted.
# fmt: off
FRAGMENTS = {
    "hermes": ["<tool_call>", "</tool_call>", '{"name": "f", "arguments": {"a": [1]}}', "{", "<",
               "tool", "_call>", '"', "x", " ", "\n", '{"name": "g"}'],
    "qwen3_coder": ["<tool_call>", "</tool_call>", "<function=f>", "</function>",
                    "<parameter=a>", "</parameter>", "\n", "1", "Paris", "<", " ", '"'],
    "mistral": ["[TOOL_CALLS]", '[{"name": "f", "arguments": {}}]', '{"name": "g"}', "[",
                "]", "f", "[ARGS]", "{}", "{", " ", "x", "[TOOL"],
    "llama3_json": ["<|python_tag|>", '{"name": "f", "parameters": {"a": 1}}', ";", " ",
                    "{", "}", '"', "x", "\n", "<|python", '{"name": "g"}'],
    "pythonic": ["[", "]", "f(x=1)", ", ", "g()", "\n", " ", "(", ")", '"', "'''", "#",
                 "x", "h(y=[1, 2])", "'", "\\", "s='a'"],
}
# fmt: on


@pytest.mark.parametrize("name", sorted(FRAGMENTS))
@settings(max_examples=150, deadline=None, database=None, derandomize=True)
@given(data=st.data())
def test_streaming_agrees_with_whole_parse_on_any_text(name: str, data: st.DataObject):
    text = "".join(data.draw(st.lists(st.sampled_from(FRAGMENTS[name]), max_size=14)))
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=6))
    parser = get_tool_parser(name)
    assert assembled(streamed(parser, text, cuts)) == whole(parser.parse(text))


def test_a_possible_marker_is_held_back_until_decided():
    stream = get_tool_parser("hermes").stream()
    assert stream.feed("Hello <tool") == [ContentDelta("Hello ")]
    assert stream.feed("_ca") == []
    assert stream.feed('ll>{"name": "f"') == []
    header, arguments = stream.feed("}</tool_call>")
    assert header.function == FunctionDelta(name="f", arguments="")
    assert arguments == ToolCallDelta(0, FunctionDelta(arguments="{}"))
    assert stream.feed(" a <") == [ContentDelta(" a ")]
    assert stream.feed("b") == [ContentDelta("<b")]
    assert stream.feed("<tool_c") == []
    assert stream.finish() == [ContentDelta("<tool_c")]


def test_mistral_and_llama3_hold_their_markers_too():
    mistral = get_tool_parser("mistral").stream()
    assert mistral.feed("Sure[TOOL_") == [ContentDelta("Sure")]
    assert mistral.feed('CALLS][{"name": "f"') == []
    assert [d.function.name for d in mistral.feed("}]")] == ["f", None]
    llama = get_tool_parser("llama3_json").stream()
    assert llama.feed("Ok <|python") == [ContentDelta("Ok ")]
    assert llama.feed('_tag|>{"name": "f", "parameters": {}}') != []


def test_deltas_have_openais_shape():
    stream = get_tool_parser("hermes").stream()
    text = '<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>' * 2
    deltas = stream.feed(text) + stream.finish()
    dicts = [delta.to_dict() for delta in deltas]
    first_id, second_id = dicts[0]["id"], dicts[2]["id"]
    assert dicts == [
        {
            "index": 0,
            "id": first_id,
            "type": "function",
            "function": {"name": "a", "arguments": ""},
        },
        {"index": 0, "function": {"arguments": '{"x": 1}'}},
        {
            "index": 1,
            "id": second_id,
            "type": "function",
            "function": {"name": "a", "arguments": ""},
        },
        {"index": 1, "function": {"arguments": '{"x": 1}'}},
    ]
    assert re.fullmatch(r"call_[A-Za-z0-9]{24}", first_id) and first_id != second_id


def test_call_ids():
    parsed = get_tool_parser("hermes").parse('<tool_call>{"name": "a"}</tool_call>' * 3)
    ids = [call.id for call in parsed.tool_calls]
    assert all(re.fullmatch(r"call_[A-Za-z0-9]{24}", i) for i in ids) and len(set(ids)) == 3
    assert parsed.tool_calls[0].to_dict() == {
        "id": ids[0],
        "type": "function",
        "function": {"name": "a", "arguments": "{}"},
    }
    # Mistral's templates refuse history whose call ids are not 9 alphanumerics.
    mistral = get_tool_parser("mistral").parse('[TOOL_CALLS][{"name": "a"}]')
    assert re.fullmatch(r"[A-Za-z0-9]{9}", mistral.tool_calls[0].id)


def test_pythonic_arguments_are_never_evaluated(tmp_path):
    marker = tmp_path / "ran"
    text = f'[f(x=open("{marker}", "w").write("x"))]'
    assert get_tool_parser("pythonic").parse(text) == ParsedOutput(text, [])
    assert not marker.exists()


def test_a_stream_ends_once():
    stream = get_tool_parser("hermes").stream()
    assert stream.feed("abc") == [ContentDelta("abc")]
    assert stream.finish() == []
    assert stream.finish() == []
    with pytest.raises(RuntimeError, match="after finish"):
        stream.feed("more")


def test_unknown_parser_names_the_known_ones():
    with pytest.raises(ValueError) as refusal:
        get_tool_parser("hermes2")
    message = str(refusal.value)
    assert "'hermes2'" in message and "--tool-call-parser" in message
    for name in ("hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder"):
        assert name in message
        assert name in tool_parser_names()


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> dict:
    """A copy of the registry for the test to change; the module's own is untouched."""
    copy = dict(tool_parsers.REGISTRY.parsers)
    monkeypatch.setattr(tool_parsers.REGISTRY, "parsers", copy)
    return copy


PLUGIN = '''
import json

from llmrpc.server.tool_parsers import FunctionCall, TaggedToolParser, register_tool_parser


@register_tool_parser("angle_calls")
class AngleCalls(TaggedToolParser):
    """<<name|{json arguments}>>"""

    start_tag = "<<"
    end_tag = ">>"

    def parse_body(self, body):
        name, _, arguments = body.partition("|")
        try:
            return [FunctionCall(name, json.dumps(json.loads(arguments or "{}")))]
        except ValueError:
            return None
'''


def test_a_plugin_file_registers_a_parser(tmp_path, registry):
    plugin = tmp_path / "angle_plugin.py"
    plugin.write_text(PLUGIN)
    assert load_tool_parser_plugin(plugin) == ["angle_calls"]
    assert "angle_calls" in tool_parser_names()
    parser = get_tool_parser("angle_calls")
    text = 'One <<f|{"a": 1}>> two <<g>> <<h|{bad>>'
    expected = ("One  two  <<h|{bad>>", [("f", '{"a": 1}'), ("g", "{}")])
    assert whole(parser.parse(text)) == expected
    assert assembled(streamed(parser, text, list(range(len(text))))) == expected


def test_a_plugin_that_fails_leaves_the_registry_as_it_was(tmp_path, registry):
    plugin = tmp_path / "broken.py"
    plugin.write_text(PLUGIN + "\nraise RuntimeError('half done')\n")
    with pytest.raises(ValueError, match="half done"):
        load_tool_parser_plugin(plugin)
    assert "angle_calls" not in tool_parser_names()
    with pytest.raises(ValueError, match="is not a file"):
        load_tool_parser_plugin(tmp_path / "missing.py")
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match="not a Python file"):
        load_tool_parser_plugin(tmp_path / "notes.txt")


def test_registration_takes_only_concrete_parsers(registry):
    with pytest.raises(ValueError, match="non-empty"):
        register_tool_parser("")
    with pytest.raises(TypeError, match="not a concrete ToolParser"):
        register_tool_parser("abstract")(ToolParser)
    with pytest.raises(TypeError, match="not a concrete ToolParser"):
        register_tool_parser("other")(dict)
