"""Logprobs and prompt logprobs equal Transformers' log-softmax (float32)."""

from __future__ import annotations

import pytest
import torch
from engine_utils import make_core, run_to_completion
from transformers import AutoModelForCausalLM

from llmrpc.engine.request import InvalidRequestError, SamplingParams

TOP = 5


@pytest.fixture(scope="module")
def core(tiny_llama_dir):
    return make_core(tiny_llama_dir, max_num_batched_tokens=16)  # prompts arrive in chunks


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()

    def log_softmax(token_ids: list[int]) -> torch.Tensor:  # [len, vocab]
        with torch.no_grad():
            return model(torch.tensor([token_ids])).logits[0].float().log_softmax(-1)

    return log_softmax


def _check(entry, expected_row: torch.Tensor, token_id: int) -> None:
    assert entry.token_id == token_id
    assert abs(entry.logprob - expected_row[token_id].item()) < 1e-4
    # the rank Transformers' values give, give or take the tokens whose logprob is within the
    # tolerance of this one's (the two float32 computations round differently)
    value = expected_row[token_id]
    assert int((expected_row > value + 1e-4).sum()) + 1 <= entry.rank
    assert entry.rank <= int((expected_row > value - 1e-4).sum()) + 1
    top_values, top_ids = expected_row.topk(TOP)
    assert [t for t, _ in entry.top] == top_ids.tolist()
    assert torch.allclose(torch.tensor([v for _, v in entry.top]), top_values, atol=1e-4)


def test_output_and_prompt_logprobs_match_transformers(core, reference, caplog):
    text = "The logprobs of a prompt long enough to be computed in two or more chunks of sixteen."
    prompt = core.tokenizer.encode(text)
    assert len(prompt) > 16
    params = SamplingParams(
        temperature=0.8, seed=3, max_tokens=12, ignore_eos=True, logprobs=TOP, prompt_logprobs=TOP
    )
    out = run_to_completion(core, {"lp": (prompt, params)})["lp"]
    expected = reference(prompt + out.token_ids)
    assert len(out.logprobs) == len(out.token_ids) == 12
    for i, (entry, token_id) in enumerate(zip(out.logprobs, out.token_ids, strict=True)):
        _check(entry, expected[len(prompt) - 1 + i], token_id)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    # chunks whose logits are all prompt positions sample nothing, and fail nothing
    assert not [r for r in caplog.records if "sampling the batch failed" in r.getMessage()]
    for position in range(1, len(prompt)):
        _check(out.prompt_logprobs[position], expected[position - 1], prompt[position])


def test_zero_logprobs_gives_the_sampled_token_only(core):
    prompt = core.tokenizer.encode("Hello")
    params = SamplingParams(temperature=0.0, max_tokens=3, logprobs=0)
    out = run_to_completion(core, {"z": (prompt, params)})["z"]
    assert [e.top for e in out.logprobs] == [[], [], []]
    assert all(e.rank == 1 for e in out.logprobs)  # greedy picks the most likely token


def test_logprobs_beyond_max_logprobs_are_refused(core):
    with pytest.raises(InvalidRequestError) as error:
        core.add_request("too-many", [1, 2, 3], SamplingParams(logprobs=21))
    assert error.value.field == "logprobs"
