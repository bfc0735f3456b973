"""Bad words and stop strings through one automaton: the same answers as trying each word, at a
per-step cost that does not grow with the number of words (issue 10, part 6)."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from llmrpc.engine.matching import SequenceAutomaton, SuffixTracker
from llmrpc.engine.output.detokenizer import IncrementalDetokenizer

SETTINGS = settings(max_examples=300, derandomize=True, database=None, deadline=None)

token_words = st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=4), max_size=12)
tokens = st.lists(st.integers(0, 5), max_size=30)
stop_lists = st.lists(st.text("abc", min_size=1, max_size=4), min_size=1, max_size=8)


def banned_by_trying_each_word(words: list[list[int]], output: list[int]) -> set[int]:
    """The old rule: ban a word's last token if the output ends with the rest of the word."""
    banned = set()
    for word in words:
        prefix = word[:-1]
        if not prefix or output[len(output) - len(prefix) :] == prefix:
            banned.add(word[-1])
    return banned


@SETTINGS
@given(token_words, tokens)
def test_bad_word_completions_equal_trying_each_word(words, output):
    tracker = SuffixTracker(SequenceAutomaton(words))
    for length in range(len(output) + 1):  # one call per step, as the sampler makes them
        completions = tracker.completions(output[:length])
        assert set(completions) == banned_by_trying_each_word(words, output[:length])


class CharTokenizer:
    """Token id i is the character chr(i): enough for the detokenizer's stop search."""

    all_special_ids: list[int] = []

    def decode(self, token_ids, skip_special_tokens=True):
        return "".join(map(chr, token_ids))


def first_stop(text: str, stops: list[str]) -> tuple[str, int] | None:
    """Reading ``text`` a character at a time: at the first character that ends some stop
    string, the one that starts earliest (the first listed on a tie), and where it starts."""
    for end in range(len(text)):
        ending = [(end - len(s) + 1, i) for i, s in enumerate(stops) if text[: end + 1].endswith(s)]
        if ending:
            start, index = min(ending)
            return stops[index], start
    return None


@SETTINGS
@given(stop_lists, st.text("abcd", max_size=40))
def test_stop_strings_are_found_where_trying_each_one_finds_them(stops, text):
    detokenizer = IncrementalDetokenizer(CharTokenizer(), [], stops)
    matched = None
    for char in text:
        matched = detokenizer.add_token(ord(char))
        if matched is not None:
            break
    expected = first_stop(text, stops)
    assert matched == (expected[0] if expected else None)
    if expected is not None:
        assert detokenizer.output_text == text[: expected[1]]


def random_words(count: int, alphabet: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(alphabet) for _ in range(rng.randint(1, 6))] for _ in range(count)]


def lookups_per_token(words: list[list[int]], output: list[int]) -> float:
    automaton = SequenceAutomaton(words)
    tracker = SuffixTracker(automaton)
    for length in range(1, len(output) + 1):
        tracker.completions(output[:length])
    return automaton.num_lookups / len(output)


def test_following_the_output_costs_the_same_for_2_or_128_bad_words():
    # A small alphabet, so the output keeps entering and leaving partial matches.
    output = [random.Random(1).randrange(4) for _ in range(2000)]
    few = lookups_per_token(random_words(2, 4, seed=2), output)
    many = lookups_per_token(random_words(128, 4, seed=3), output)
    assert many <= 2 and few <= 2  # amortized: one transition, plus failure hops paid earlier


def test_stop_search_reads_each_new_character_a_bounded_number_of_times():
    rng = random.Random(4)
    stops = ["".join(rng.choice("ab") for _ in range(rng.randint(2, 12))) + "c" for _ in range(64)]
    detokenizer = IncrementalDetokenizer(CharTokenizer(), [], stops)
    automaton = detokenizer.stop_automaton
    before = automaton.num_lookups
    text = "".join(rng.choice("ab") for _ in range(3000))  # never a "c": no stop ends
    for char in text:
        assert detokenizer.add_token(ord(char)) is None
    assert (automaton.num_lookups - before) / len(text) <= 2
