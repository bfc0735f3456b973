"""allowed_token_ids and bad_words hold whatever the other parameters do to the logits: rows that
end up all -inf, NaN or +inf still yield a permitted token (issue 10, part 7)."""

from __future__ import annotations

import pytest
import torch

from llmrpc.engine.matching import SequenceAutomaton, SuffixTracker
from llmrpc.engine.request import Request, SamplingParams
from llmrpc.engine.sample.sampler import Sampler

VOCAB = 400
ALLOWED = [100, 200, 300]
NEG_INF = float("-inf")


def logits(rows: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def sample(params: SamplingParams, row: torch.Tensor, prompt=(1,), draws: int = 1) -> list[int]:
    """Tokens picked over ``draws`` calls, each on a fresh copy of ``row`` [1, VOCAB]."""
    request = Request("r", list(prompt), params, eos_token_ids=frozenset({2}))
    generator = torch.Generator().manual_seed(0)
    sampler = Sampler()
    return [sampler(row.clone(), [request], [generator]).token_ids[0] for _ in range(draws)]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_allowed_tokens_all_biased_to_minus_inf_still_pick_an_allowed_one(temperature):
    # Not reachable through validation any more (|bias| <= 100), but the sampler must not care.
    params = SamplingParams(
        temperature=temperature,
        allowed_token_ids=ALLOWED,
        logit_bias=dict.fromkeys(ALLOWED, NEG_INF),
    )
    assert set(sample(params, logits(), draws=20)) <= set(ALLOWED)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_a_repetition_penalty_that_overflows_keeps_the_allowed_tokens(temperature):
    # Valid parameters: every allowed token is in the prompt with a negative logit, so a huge
    # penalty multiplies each to -inf.
    row = logits()
    row[0, ALLOWED] = -2.0  # -2 * 3e38 overflows float32
    params = SamplingParams(
        temperature=temperature, repetition_penalty=3e38, allowed_token_ids=ALLOWED
    )
    assert set(sample(params, row, prompt=ALLOWED, draws=20)) <= set(ALLOWED)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_penalty_that_overflows_to_plus_inf_picks_that_token(temperature):
    row = logits()
    row[0, ALLOWED] = torch.tensor([-1.0, 5.0, -3.0])
    params = SamplingParams(
        temperature=temperature, repetition_penalty=1e-38, allowed_token_ids=ALLOWED
    )
    assert set(sample(params, row, prompt=ALLOWED, draws=20)) == {200}  # 5 / 1e-38 = +inf


def test_huge_finite_temperature_samples_the_allowed_tokens_evenly():
    params = SamplingParams(temperature=3e38, allowed_token_ids=ALLOWED)
    picked = sample(params, logits(), draws=300)
    assert set(picked) == set(ALLOWED)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_p=0.5),
        SamplingParams(temperature=1.0, top_k=2),
        SamplingParams(temperature=1.0, min_p=0.5),
        SamplingParams(temperature=0.0),
    ],
    ids=["top_p", "top_k", "min_p", "greedy"],
)
def test_nan_logits_from_the_model_still_give_an_allowed_token(params):
    params.allowed_token_ids = ALLOWED
    row = torch.full((1, VOCAB), float("nan"))
    assert set(sample(params, row, draws=10)) <= set(ALLOWED)


def test_bad_words_hold_against_a_maximal_bias():
    request = Request("r", [1], SamplingParams(temperature=0.0, logit_bias={7: 100.0}))

    request.bad_words = SuffixTracker(SequenceAutomaton([[7]]))
    token = Sampler()(logits(), [request], [torch.Generator()]).token_ids[0]
    assert token != 7


def test_when_bad_words_ban_every_allowed_token_the_allowed_tokens_win():

    request = Request("r", [1], SamplingParams(temperature=0.0, allowed_token_ids=[100, 200]))
    request.bad_words = SuffixTracker(SequenceAutomaton([[100], [200]]))
    token = Sampler()(logits(), [request], [torch.Generator()]).token_ids[0]
    assert token in (100, 200)


def test_a_broken_row_does_not_disturb_the_others():
    rows = logits(rows=3)
    rows[1] = float("nan")
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, allowed_token_ids=ALLOWED),
        SamplingParams(temperature=0.0),
    ]
    requests = [Request(f"r{i}", [1], p) for i, p in enumerate(params)]
    tokens = Sampler()(rows.clone(), requests, [torch.Generator() for _ in params]).token_ids
    assert tokens[0] == rows[0].argmax() and tokens[2] == rows[2].argmax()
    assert tokens[1] in ALLOWED
