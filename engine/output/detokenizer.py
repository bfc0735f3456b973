"""Incremental detokenization and stop strings.

Text is decoded over a short sliding window of token ids, so each step costs the same however long
the output is, and a multi-byte character split over tokens is emitted only once it is whole.
Stop strings are searched in the decoded text by an automaton that reads each new character
once, whatever the number of stop strings; while a stop string could still be completing, its
possible beginning is held back, so a stop string is never streamed out before it is cut.
"""

from __future__ import annotations

import functools

from llmrpc.engine.matching import ROOT, SequenceAutomaton

_REPLACEMENT_CHAR = "\ufffd"
_PROMPT_CONTEXT_TOKENS = 5  # prompt tokens decoded with the first output tokens, for spacing


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer,
        prompt_token_ids: list[int],
        stop: list[str] | tuple[str, ...] = (),
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.stop = list(stop)
        self.include_stop_str_in_output = include_stop_str_in_output
        self.skip_special_tokens = skip_special_tokens
        # Kept special tokens stand apart from the text around them, one space each side.
        self.special_ids = (
            frozenset(tokenizer.all_special_ids)
            if spaces_between_special_tokens and not skip_special_tokens
            else frozenset()
        )
        self.token_ids = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.output_text = ""
        self.num_emitted_chars = 0
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.stop_automaton = stop_automaton(tuple(self.stop)) if self.stop else None
        self.stop_state = ROOT  # where output_text so far stands in the automaton

    def add_token(self, token_id: int) -> str | None:
        """Decode one more token; returns the stop string it completed, if any."""
        self.token_ids.append(token_id)
        prefix = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith(_REPLACEMENT_CHAR):
            return None  # nothing printable yet (e.g. half of a UTF-8 character)
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        previous_len = len(self.output_text)
        self.output_text += full[len(prefix) :]
        return self._find_stop(previous_len)

    def _decode(self, token_ids: list[int]) -> str:
        if not self.special_ids:
            return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)
        segments, run = [], []
        for token_id in token_ids:
            if token_id in self.special_ids:
                if run:
                    segments.append(self.tokenizer.decode(run))
                    run = []
                segments.append(self.tokenizer.decode([token_id]))
            else:
                run.append(token_id)
        if run:
            segments.append(self.tokenizer.decode(run))
        return " ".join(segments)

    def _find_stop(self, previous_len: int) -> str | None:
        """The stop string ending in the text after ``previous_len`` that starts first (on a tie,
        the first listed); the output is cut there."""
        if self.stop_automaton is None:
            return None
        automaton, best = self.stop_automaton, None  # best: (start, index in self.stop)
        for end in range(previous_len, len(self.output_text)):
            self.stop_state = automaton.step(self.stop_state, self.output_text[end])
            for index in automaton.matches(self.stop_state):
                start = end - len(self.stop[index]) + 1
                best = min(best, (start, index)) if best is not None else (start, index)
        if best is None:
            return None
        index, stop = best[0], self.stop[best[1]]
        end = index + len(stop) if self.include_stop_str_in_output else index
        self.output_text = self.output_text[:end]
        return stop

    def take_delta(self, finished: bool) -> str:
        """New text to hand out; keeps back what could be the start of a stop string."""
        end = len(self.output_text)
        if not finished and self.stop:
            end = max(self.num_emitted_chars, end - self.holdback)
        delta = self.output_text[self.num_emitted_chars : end]
        self.num_emitted_chars = end
        return delta


@functools.lru_cache(maxsize=8)  # at the bounds an automaton is a few MB: keep few
def stop_automaton(stop: tuple[str, ...]) -> SequenceAutomaton:
    """One automaton per distinct stop list: the n samples of a request (and requests that
    repeat a list) share it; each detokenizer keeps its own state."""
    return SequenceAutomaton(stop)
