"""Reasoning parsers: scripted outputs split exactly into reasoning and content; streaming any
split of an output gives what the whole parse gives, with tags held back and never sent."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmrpc.server import reasoning_parsers
from llmrpc.server.reasoning_parsers import (
    ReasoningParser,
    Step,
    get_reasoning_parser,
    load_reasoning_parser_plugin,
    reasoning_parser_names,
    register_reasoning_parser,
)

# (parser, output, reasoning, content)
CASES = [
    ("deepseek_r1", "Let me think.\n</think>\n\nParis.", "Let me think.\n", "\n\nParis."),
    ("deepseek_r1", "<think>Hmm</think>Paris", "Hmm", "Paris"),
    ("deepseek_r1", " \n<think>\nHmm</think>Paris", "\nHmm", "Paris"),
    ("deepseek_r1", "Still thinking, no end", "Still thinking, no end", None),
    ("deepseek_r1", "<think>Still thinking", "Still thinking", None),
    ("deepseek_r1", "</think>Only an answer", None, "Only an answer"),
    ("deepseek_r1", "a</think>b</think>c<think>d", "a", "b</think>c<think>d"),
    ("deepseek_r1", "<thinking>x</think>y", "<thinking>x", "y"),
    ("deepseek_r1", "Überlegung 🤔</think>Antwort: 東京", "Überlegung 🤔", "Antwort: 東京"),
    ("deepseek_r1", "<think>\n\n</think>\n\n", None, None),
    ("deepseek_r1", "", None, None),
    ("qwen3", "<think>\nThe user asks.\n</think>\n\nParis.", "\nThe user asks.\n", "\n\nParis."),
    ("qwen3", "\n<think>a</think>b", "a", "b"),
    ("qwen3", "<think>Never closed", "Never closed", None),
    ("qwen3", "Plain answer, no tags.", None, "Plain answer, no tags."),
    ("qwen3", "Opened by the template</think>Answer", "Opened by the template", "Answer"),
    ("qwen3", "Intro <think>why</think> answer", "why", "Intro  answer"),
    ("qwen3", "Intro <think>never closed", None, "Intro <think>never closed"),
    ("qwen3", "x</think>y<think>z", "x", "y<think>z"),
    ("qwen3", "<think>a</think>b</think>c", "a", "b</think>c"),
    ("qwen3", "<thinking>a", None, "<thinking>a"),
    ("qwen3", "<think>思考</think>答え ✓", "思考", "答え ✓"),
    ("qwen3", "<think>\n\n</think>\n\n", None, None),
    ("qwen3", "   ", None, None),
]
IDS = [f"{name}-{i}" for i, (name, *_) in enumerate(CASES)]


def streamed(parser: ReasoningParser, text: str, cuts: list[int]) -> list[tuple]:
    stream, pieces, start = parser.stream(), [], 0
    for cut in [*sorted(cuts), len(text)]:
        pieces.append(stream.feed(text[start:cut]))
        start = cut
    return [*pieces, stream.finish()]


def joined(pieces: list[tuple]) -> tuple[str | None, str | None]:
    for reasoning, content in pieces:
        assert reasoning != "" and content != "", "an empty delta instead of None"
    reasoning = "".join(r for r, _ in pieces if r is not None)
    content = "".join(c for _, c in pieces if c is not None)
    return reasoning or None, content or None


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), CASES, ids=IDS)
def test_whole_output_splits_as_scripted(name, text, reasoning, content):
    assert get_reasoning_parser(name).parse(text) == (reasoning, content)


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), CASES, ids=IDS)
@settings(max_examples=40, deadline=None, database=None, derandomize=True)
@given(data=st.data())
def test_streaming_any_split_gives_the_whole_parse(name, text, reasoning, content, data):
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=8))
    assert joined(streamed(get_reasoning_parser(name), text, cuts)) == (reasoning, content)


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), CASES, ids=IDS)
def test_streaming_one_character_at_a_time(name, text, reasoning, content):
    pieces = streamed(get_reasoning_parser(name), text, list(range(len(text))))
    assert joined(pieces) == (reasoning, content)


FRAGMENTS = ["<think>", "</think>", "<", "</", "<th", "think>", "/", "a", " ", "\n", "é"]


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
@settings(max_examples=200, deadline=None, database=None, derandomize=True)
@given(data=st.data())
def test_streaming_agrees_with_whole_parse_on_any_text(name, data):
    text = "".join(data.draw(st.lists(st.sampled_from(FRAGMENTS), max_size=14)))
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=6))
    parser = get_reasoning_parser(name)
    assert joined(streamed(parser, text, cuts)) == parser.parse(text)


def test_deepseek_streams_reasoning_and_holds_partial_tags():
    stream = get_reasoning_parser("deepseek_r1").stream()
    assert stream.feed("<th") == (None, None)
    assert stream.feed("ink>Okay, ") == ("Okay, ", None)
    assert stream.feed("so</thi") == ("so", None)
    assert stream.feed("nk>\n\n") == (None, None)  # content so far is only whitespace
    assert stream.feed("Paris<") == (None, "\n\nParis<")
    assert stream.finish() == (None, None)


def test_qwen3_streams_reasoning_when_the_output_opens_it():
    stream = get_reasoning_parser("qwen3").stream()
    assert stream.feed("<think>") == (None, None)
    assert stream.feed("Hmm. <") == ("Hmm. ", None)
    assert stream.feed("/think>Yes") == (None, "Yes")


def test_qwen3_holds_unmarked_output_until_a_tag_decides_it():
    stream = get_reasoning_parser("qwen3").stream()
    assert stream.feed("Could be either") == (None, None)
    assert stream.feed(" way.</think>") == ("Could be either way.", None)
    other = get_reasoning_parser("qwen3").stream()
    assert other.feed("Plain answer") == (None, None)
    assert other.feed(" <think>x") == (None, "Plain answer ")
    assert other.finish() == (None, "<think>x")


def test_a_stream_ends_once():
    stream = get_reasoning_parser("deepseek_r1").stream()
    assert stream.feed("a") == ("a", None)
    assert stream.finish() == (None, None)
    assert stream.finish() == (None, None)
    with pytest.raises(RuntimeError, match="after finish"):
        stream.feed("b")


def test_unknown_parser_names_the_known_ones():
    with pytest.raises(ValueError) as refusal:
        get_reasoning_parser("deepseek")
    message = str(refusal.value)
    assert "'deepseek'" in message and "deepseek_r1" in message and "qwen3" in message
    assert {"deepseek_r1", "qwen3"} <= set(reasoning_parser_names())


PLUGIN = '''
from llmrpc.server.reasoning_parsers import ReasoningParser, Step, register_reasoning_parser


@register_reasoning_parser("bang")
class Bang(ReasoningParser):
    """Reasoning up to the first "!", content after it."""

    def step(self, text, pos, state, final):
        if state == "content":
            return Step(len(text), "content", content=text[pos:])
        bang = text.find("!", pos)
        if bang < 0:
            return Step(len(text), "start", reasoning=text[pos:])
        return Step(bang + 1, "content", reasoning=text[pos:bang])
'''


def test_a_plugin_file_registers_a_parser(tmp_path, monkeypatch):
    monkeypatch.setattr(
        reasoning_parsers.REGISTRY, "parsers", dict(reasoning_parsers.REGISTRY.parsers)
    )
    plugin = tmp_path / "bang_plugin.py"
    plugin.write_text(PLUGIN)
    assert load_reasoning_parser_plugin(plugin) == ["bang"]
    parser = get_reasoning_parser("bang")
    assert parser.parse("hmm!yes") == ("hmm", "yes")
    assert joined(streamed(parser, "hmm!yes", [1, 3, 4])) == ("hmm", "yes")
    broken = tmp_path / "broken.py"
    broken.write_text("raise ImportError('nope')")
    with pytest.raises(ValueError, match="nope"):
        load_reasoning_parser_plugin(broken)
    assert "bang" in reasoning_parser_names()


def test_registration_takes_only_concrete_parsers(monkeypatch):
    monkeypatch.setattr(
        reasoning_parsers.REGISTRY, "parsers", dict(reasoning_parsers.REGISTRY.parsers)
    )
    with pytest.raises(TypeError, match="not a concrete ReasoningParser"):
        register_reasoning_parser("abstract")(ReasoningParser)
    with pytest.raises(ValueError, match="non-empty"):
        register_reasoning_parser(" ")


def test_a_parser_that_makes_no_progress_is_a_bug_not_a_hang():
    class Stuck(ReasoningParser):
        def step(self, text, pos, state, final):
            return Step(pos, state)

    with pytest.raises(RuntimeError, match="no progress"):
        Stuck().parse("abc")
