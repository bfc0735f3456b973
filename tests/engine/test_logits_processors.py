"""Penalties, logit bias, bad words, min_tokens, allowed tokens: as Transformers' processors do."""

from __future__ import annotations

import torch
from transformers import (
    MinNewTokensLengthLogitsProcessor,
    NoBadWordsLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from llmrpc.engine.matching import SequenceAutomaton, SuffixTracker
from llmrpc.engine.request import Request, SamplingParams
from llmrpc.engine.sample.logits_processors import apply_logits_processors

VOCAB = 64
EOS = 3
PROMPT = [5, 9, 9, 20, 31]
OUTPUT = [9, 40, 41, 40]


def _request(params: SamplingParams, output=OUTPUT) -> Request:
    request = Request("r", PROMPT, params, eos_token_ids=frozenset({EOS}))
    for token in output:
        request.append_output_token(token)
    return request


def _ours(params: SamplingParams, logits: torch.Tensor, output=OUTPUT) -> torch.Tensor:
    out = logits.clone()
    apply_logits_processors(out, [_request(params, output)])
    return out


def _theirs(processor, logits: torch.Tensor, output=OUTPUT) -> torch.Tensor:
    return processor(torch.tensor([PROMPT + output]), logits.clone())


def _logits() -> torch.Tensor:
    return torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(0)) * 3


def test_repetition_penalty_matches_transformers():
    logits = _logits()
    ours = _ours(SamplingParams(repetition_penalty=1.7), logits)
    theirs = _theirs(RepetitionPenaltyLogitsProcessor(1.7), logits)
    assert torch.allclose(ours, theirs)
    assert not torch.allclose(ours, logits)


def test_logit_bias_matches_sequence_bias():
    logits = _logits()
    bias = {7: 5.0, 12: -3.5, 63: 100.0}
    ours = _ours(SamplingParams(logit_bias=bias), logits)
    theirs = _theirs(SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()}), logits)
    assert torch.allclose(ours, theirs)


def test_min_tokens_matches_min_new_tokens():
    logits = _logits()
    processor = MinNewTokensLengthLogitsProcessor(len(PROMPT), 6, EOS)
    ours = _ours(SamplingParams(min_tokens=6), logits)
    assert torch.equal(ours, _theirs(processor, logits))
    assert ours[0, EOS] == float("-inf")
    reached = _ours(SamplingParams(min_tokens=4), logits)  # four output tokens already
    assert torch.equal(reached, logits)


def test_bad_words_match_no_bad_words():
    logits = _logits()
    request = _request(SamplingParams(bad_words=["x"]))
    request.bad_words = SuffixTracker(SequenceAutomaton([[41, 40, 17], [41, 50], [22]]))
    ours = logits.clone()
    apply_logits_processors(ours, [request])
    theirs = _theirs(NoBadWordsLogitsProcessor([[41, 40, 17], [41, 50], [22]], EOS), logits)
    assert torch.equal(ours, theirs)
    assert ours[0, 17] == float("-inf") and ours[0, 22] == float("-inf")
    assert ours[0, 50] == logits[0, 50]  # its prefix [41] is not what the output ends with


def test_presence_and_frequency_penalties_follow_the_openai_formula():
    logits = _logits()
    ours = _ours(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), logits)
    expected = logits.clone()
    for token, count in {9: 1, 40: 2, 41: 1}.items():  # output tokens only, not the prompt
        expected[0, token] -= 0.25 * count + 0.5
    assert torch.allclose(ours, expected)


def test_allowed_token_ids_mask_every_other_token():
    logits = _logits()
    ours = _ours(SamplingParams(allowed_token_ids=[4, 8]), logits)
    assert torch.isfinite(ours[0]).nonzero().flatten().tolist() == [4, 8]
    assert torch.equal(ours[0, [4, 8]], logits[0, [4, 8]])


def test_every_rule_runs_inside_a_real_engine_step(tiny_llama_dir):
    from engine_utils import make_core, run_to_completion

    core = make_core(tiny_llama_dir)
    params = SamplingParams(
        temperature=0.8,
        seed=1,
        max_tokens=6,
        min_tokens=3,
        repetition_penalty=1.2,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        logit_bias={100: 2.0},
        allowed_token_ids=list(range(100, 200)),
        bad_words=["hello"],
        logprobs=2,
    )
    out = run_to_completion(core, {"all": (core.tokenizer.encode("Hi"), params)})["all"]
    assert len(out.token_ids) == 6
    assert all(100 <= t < 200 for t in out.token_ids)
