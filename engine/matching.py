"""Multi-pattern matching for the client-supplied lists searched at every step: bad words (token
sequences) and stop strings (character sequences).

Both use one Aho-Corasick automaton, built once per request: the state after a text is the
longest suffix of that text which begins some pattern. Feeding it the symbols a step adds costs
those symbols (plus failure-link hops that earlier symbols paid for), however many patterns there
are; the patterns that end here, or that one more symbol would complete, are found by following
links between suffix states rather than by trying each pattern.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterable, Iterator, Sequence

ROOT = 0
_NONE = -1


class SequenceAutomaton:
    """Aho-Corasick over ``patterns`` (sequences of hashable symbols); states are ints."""

    def __init__(self, patterns: Iterable[Sequence[Hashable]]) -> None:
        self.patterns = [tuple(p) for p in patterns]
        self._goto: list[dict] = [{}]
        self._pattern_at: list[int] = [_NONE]  # first pattern (by index) ending at this state
        for index, pattern in enumerate(self.patterns):
            self._insert(index, pattern)
        num_states = len(self._goto)
        self._fail = [ROOT] * num_states
        self._match_link = [_NONE] * num_states  # nearest proper suffix where a pattern ends
        # Symbols that end a pattern from this state, and the nearest proper suffix with some.
        self._completions = [self._completing(s) for s in range(num_states)]
        self._completion_link = [_NONE] * num_states
        self.num_lookups = 0  # transitions tried by step(): the work it did, for tests
        self._link()

    def _insert(self, index: int, pattern: tuple) -> None:
        state = ROOT
        for symbol in pattern:
            following = self._goto[state].get(symbol)
            if following is None:
                following = len(self._goto)
                self._goto[state][symbol] = following
                self._goto.append({})
                self._pattern_at.append(_NONE)
            state = following
        if self._pattern_at[state] == _NONE:
            self._pattern_at[state] = index

    def _completing(self, state: int) -> list:
        return [s for s, t in self._goto[state].items() if self._pattern_at[t] != _NONE]

    def _link(self) -> None:
        """Failure links in breadth-first order: a state's suffixes are shallower than it."""
        queue = deque(self._goto[ROOT].values())
        while queue:
            state = queue.popleft()
            fail = self._fail[state]
            self._match_link[state] = (
                fail if self._pattern_at[fail] != _NONE else (self._match_link[fail])
            )
            self._completion_link[state] = (
                fail if self._completions[fail] else (self._completion_link[fail])
            )
            for symbol, child in self._goto[state].items():
                self._fail[child] = self.step(fail, symbol) if state != ROOT else ROOT
                queue.append(child)
        self.num_lookups = 0

    def step(self, state: int, symbol: Hashable) -> int:
        """The state after ``symbol`` follows the text that led to ``state``."""
        while True:
            self.num_lookups += 1
            following = self._goto[state].get(symbol)
            if following is not None:
                return following
            if state == ROOT:
                return ROOT
            state = self._fail[state]

    def matches(self, state: int) -> Iterator[int]:
        """Indices of the patterns that end at ``state`` (the text's end), longest first."""
        if self._pattern_at[state] == _NONE:
            state = self._match_link[state]
        while state != _NONE:
            yield self._pattern_at[state]
            state = self._match_link[state]

    def completions(self, state: int) -> list:
        """The symbols that, appended next, would end some pattern."""
        symbols = []
        if not self._completions[state]:
            state = self._completion_link[state]
        while state != _NONE:
            symbols.extend(self._completions[state])
            state = self._completion_link[state]
        return symbols


class SuffixTracker:
    """Follows one growing token list (a request's output) through an automaton."""

    def __init__(self, automaton: SequenceAutomaton) -> None:
        self.automaton = automaton
        self.state = ROOT
        self.num_consumed = 0

    def completions(self, token_ids: list[int]) -> list[int]:
        """Tokens that would end a pattern after ``token_ids``, which grew since the last call."""
        if len(token_ids) < self.num_consumed:  # never expected: start over rather than be wrong
            self.state, self.num_consumed = ROOT, 0
        for token_id in token_ids[self.num_consumed :]:
            self.state = self.automaton.step(self.state, token_id)
        self.num_consumed = len(token_ids)
        return self.automaton.completions(self.state)
