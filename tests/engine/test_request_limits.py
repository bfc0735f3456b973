"""Request limits: every list is bounded, every float must be finite, and each refusal names the
field (issue 10, parts 6 and 7)."""

from __future__ import annotations

import math

import pytest

from llmrpc.engine import request as limits
from llmrpc.engine.core.input_processor import InputLimits, InputProcessor
from llmrpc.engine.request import InvalidRequestError, SamplingParams

VOCAB = 1000

FLOAT_FIELDS = [
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "time_limit_s",
]


def refusal(**fields) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as failure:
        SamplingParams(**fields).validate()
    return failure.value


@pytest.mark.parametrize("name", FLOAT_FIELDS)
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_floats_are_refused_by_name(name, value):
    error = refusal(**{name: value})
    assert error.field == name
    assert error.message == "must be a finite number"


@pytest.mark.parametrize("bias", [math.nan, math.inf, -math.inf, 100.5, -101.0])
def test_logit_bias_values_must_be_finite_and_within_100(bias):
    error = refusal(logit_bias={5: 1.0, 7: bias})
    assert error.field == "logit_bias"
    SamplingParams(logit_bias={5: 100.0, 7: -100.0}).validate()  # the bounds themselves


def test_finite_huge_temperature_is_accepted():
    SamplingParams(temperature=3e38).validate()


@pytest.mark.parametrize(
    ("name", "bound", "item"),
    [
        ("stop", limits.MAX_STOP_STRINGS, "x"),
        ("bad_words", limits.MAX_BAD_WORDS, "x"),
        ("stop_token_ids", limits.MAX_STOP_TOKEN_IDS, 1),
    ],
)
def test_lists_are_bounded(name, bound, item):
    SamplingParams(**{name: [item] * bound}).validate()
    error = refusal(**{name: [item] * (bound + 1)})
    assert error.field == name
    assert str(bound) in error.message


def test_logit_bias_entries_are_bounded():
    SamplingParams(logit_bias=dict.fromkeys(range(limits.MAX_LOGIT_BIAS), 1.0)).validate()
    error = refusal(logit_bias=dict.fromkeys(range(limits.MAX_LOGIT_BIAS + 1), 1.0))
    assert error.field == "logit_bias"


@pytest.mark.parametrize(
    ("name", "bound"),
    [("stop", limits.MAX_STOP_STRING_CHARS), ("bad_words", limits.MAX_BAD_WORD_CHARS)],
)
def test_each_string_is_bounded(name, bound):
    SamplingParams(**{name: ["a" * bound]}).validate()
    error = refusal(**{name: ["ok", "a" * (bound + 1)]})
    assert error.field == f"{name}[1]"
    assert str(bound) in error.message
    assert refusal(**{name: ["ok", ""]}).field == f"{name}[1]"


def test_an_oversized_list_is_refused_for_its_size_before_its_items_are_read():
    error = refusal(stop=[""] * 10**6)  # empty strings too, but the size is what is wrong
    assert error.field == "stop"
    assert str(limits.MAX_STOP_STRINGS) in error.message


def test_n_is_bounded():
    SamplingParams(n=limits.MAX_N).validate()
    error = refusal(n=limits.MAX_N + 1)
    assert error.field == "n"
    assert str(limits.MAX_N) in error.message


@pytest.mark.parametrize("seed", [-1, 2**64])
def test_seed_must_fit_a_generator(seed):
    assert refusal(seed=seed).field == "seed"


def processor(max_logprobs: int = 20) -> InputProcessor:
    return InputProcessor(InputLimits(512, VOCAB, max_logprobs), None, frozenset({2}))


def test_allowed_token_ids_are_bounded_by_the_vocabulary():
    allowed = list(range(VOCAB))
    assert len(processor().make_requests("a", [1], SamplingParams(allowed_token_ids=allowed)))
    with pytest.raises(InvalidRequestError) as failure:
        processor().make_requests("b", [1], SamplingParams(allowed_token_ids=allowed + [0]))
    assert failure.value.field == "allowed_token_ids"


@pytest.mark.parametrize("name", ["logprobs", "prompt_logprobs"])
def test_unlimited_logprobs_still_stop_at_the_vocabulary(name):
    unlimited = processor(max_logprobs=-1)
    unlimited.make_requests("a", [1], SamplingParams(**{name: VOCAB}))
    with pytest.raises(InvalidRequestError) as failure:
        unlimited.make_requests("b", [1], SamplingParams(**{name: VOCAB + 1}))
    assert failure.value.field == name


class TokenizerWithExtraTokens:
    """A tokenizer whose added tokens lie beyond the model's vocabulary (it happens)."""

    def encode(self, text, add_special_tokens=False):
        return [VOCAB + 5] if "extra" in text else [7, 8]


def test_bad_words_beyond_the_models_vocabulary_are_left_out():
    inputs = InputProcessor(InputLimits(512, VOCAB, 20), TokenizerWithExtraTokens(), frozenset())
    params = SamplingParams(bad_words=["extra", "ok"])
    (request,) = inputs.make_requests("r", [1], params)
    request.append_output_token(7)
    assert request.bad_words.completions(request.output_token_ids) == [8]
    assert all(t < VOCAB for p in request.bad_words.automaton.patterns for t in p)
