"""Sampling: seeded requests are batch-independent; the sampler's filters do what they say."""

from __future__ import annotations

import pytest
import torch
from engine_utils import make_core, run_to_completion

from llmrpc.engine.request import Request, SamplingParams
from llmrpc.engine.sample.sampler import Sampler, _processed_logits

SEEDED = SamplingParams(
    temperature=0.9, top_p=0.95, top_k=100, seed=1234, max_tokens=24, ignore_eos=True
)


def _prompt(core, text: str) -> list[int]:
    return core.tokenizer.encode(text)


@pytest.fixture(scope="module")
def core(tiny_llama_dir):
    return make_core(tiny_llama_dir, max_num_batched_tokens=48)


def test_seeded_request_gives_the_same_tokens_alone_and_in_a_busy_batch(core):
    prompt = _prompt(core, "Tell me a story about a lighthouse keeper.")
    alone = run_to_completion(core, {"alone": (prompt, SEEDED)})["alone"].token_ids
    assert len(alone) == 24

    # The same request joins mid-way into a batch of greedy and differently seeded requests.
    for i in range(7):
        other = SamplingParams(temperature=0.7 if i % 2 else 0.0, seed=i, max_tokens=40)
        core.add_request(f"busy{i}", _prompt(core, "Filler text " * (i + 1)), other)
    core.step()
    core.step()
    outputs = run_to_completion(core, {"batched": (prompt, SEEDED)})
    assert outputs["batched"].token_ids == alone
    assert sum(1 for rid in outputs if rid.startswith("busy")) == 7


def test_different_seeds_sample_different_tokens(core):
    prompt = _prompt(core, "Once upon a time")
    runs = {
        f"s{seed}": (prompt, SamplingParams(temperature=1.0, seed=seed, max_tokens=16))
        for seed in (1, 2)
    }
    outputs = run_to_completion(core, runs)
    assert outputs["s1"].token_ids != outputs["s2"].token_ids


def _requests(*params: SamplingParams) -> list[Request]:
    return [Request(f"r{i}", [1], p, eos_token_ids=frozenset({2})) for i, p in enumerate(params)]


def _generators(n: int, seed: int = 0) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed + i) for i in range(n)]


def test_greedy_and_degenerate_filters_pick_the_argmax():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=1.0, top_p=1e-6),
        SamplingParams(temperature=1.0, min_p=1.0),
    ]
    tokens = Sampler()(logits.clone(), _requests(*params), _generators(4)).token_ids
    assert tokens == logits.argmax(-1).tolist()


def test_sampled_frequencies_follow_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.2])
    generator = torch.Generator().manual_seed(7)
    request = _requests(SamplingParams(temperature=1.0))
    counts = torch.zeros(3)
    sampler = Sampler()
    for _ in range(4000):
        token = sampler(probs.log().unsqueeze(0), request, [generator]).token_ids[0]
        counts[token] += 1
    assert torch.allclose(counts / counts.sum(), probs, atol=0.03)


def test_top_k_and_top_p_exclude_the_tail():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]]).log_softmax(-1)
    sampler = Sampler()
    top_k = _requests(SamplingParams(temperature=1.0, top_k=2))
    top_p = _requests(SamplingParams(temperature=1.0, top_p=0.5))
    gen = torch.Generator().manual_seed(3)
    seen_k = {sampler(logits.clone(), top_k, [gen]).token_ids[0] for _ in range(300)}
    seen_p = {sampler(logits.clone(), top_p, [gen]).token_ids[0] for _ in range(300)}
    assert seen_k == {0, 1}
    # Softmax of the logits is [0.64, 0.24, ...]: the first token alone covers 0.5.
    assert seen_p == {0}


def test_a_row_without_top_p_keeps_its_tail_beside_a_row_with_it():
    # One token holds all but 1e-10 of the mass: float32 running sums reach exactly 1.0 after
    # it, which top_p = 1 must not read as "covered" (the filters run for the batch because the
    # other row has top_p = 0.5).
    logits = torch.zeros(2, 1000)
    logits[:, 0] = 30.0
    requests = _requests(
        SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_p=0.5)
    )
    processed = _processed_logits(logits.clone(), requests)
    assert bool(processed[0].isfinite().all())
    assert processed[1].isfinite().sum() == 1


def test_the_triton_sampler_keeps_the_torch_samplers_tokens_and_repeats_a_seed():
    # Triton's kernel interpreted on the CPU (tests/conftest.py sets TRITON_INTERPRET=1)
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(5)) * 3
    requests = _requests(
        SamplingParams(temperature=0.8, top_k=20, seed=1),
        SamplingParams(temperature=1.0, top_p=0.6, seed=2),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=3),
    )
    kept = _processed_logits(logits.clone(), requests).isfinite()
    sampler = Sampler(backend="triton")
    for trial in range(6):
        tokens = sampler(logits.clone(), requests, _generators(4, seed=trial)).token_ids
        assert all(kept[row, token] for row, token in enumerate(tokens)), (trial, tokens)
        assert tokens[2] == int(logits[2].argmax())
        again = sampler(logits.clone(), requests, _generators(4, seed=trial)).token_ids
        assert again == tokens
        alone = sampler(logits[3:].clone(), requests[3:], _generators(4, seed=trial)[3:])
        assert alone.token_ids == tokens[3:]


def test_min_tokens_masks_eos_and_stop_tokens_until_reached():
    logits = torch.tensor([[0.0, 0.0, 10.0, 9.0, 1.0]])  # EOS (2) then stop token 3 lead
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[3])
    request = _requests(params)
    assert Sampler()(logits.clone(), request, _generators(1)).token_ids == [4]
    request[0].output_token_ids = [4, 4]
    assert Sampler()(logits.clone(), request, _generators(1)).token_ids == [2]


def test_a_step_with_no_row_to_sample_samples_nothing_on_any_device():
    # A step of non-final prompt chunks only: no logits rows, no requests. On the meta device
    # (standing in for CUDA) the empty case once mixed devices and raised inside the sampler.
    for backend in ("torch", "triton"):
        output = Sampler(backend=backend)(torch.empty(0, 49152, device="meta"), [], [])
        assert output.token_ids == [] and output.logprobs == []
