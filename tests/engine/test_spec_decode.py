"""Speculative decoding (``--speculative-config``, ngram and draft_model) on the engine: the
same greedy tokens as without it, the same distribution when sampling, every rule of the
sampler inside an accepted run, and the KV caches rolled back where drafts fail.

The random-weight tiny model falls into loops of its own output, which prompt lookup predicts:
each test checks that drafts were accepted (and rejected), so it exercises both paths.
"""

from __future__ import annotations

import dataclasses
import json
import random
import types

import jsonschema
import pytest
from engine_utils import make_core, run_to_completion
from scipy.stats import chi2_contingency

from llmrpc.engine.config import EngineConfig
from llmrpc.engine.request import FinishReason, SamplingParams, StructuredOutputSpec
from llmrpc.engine.spec_decode.config import SpeculativeConfig
from llmrpc.engine.spec_decode.ngram import NgramProposer, lookup
from llmrpc.engine.spec_decode.proposer import StepCost
from llmrpc.engine.structured_output import grammar as structured_output

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}  # fmt: skip


class _WrongAtTimes(NgramProposer):
    """Prompt lookup, with one draft of every other proposal made wrong, at a random position:
    the tiny model's greedy loops are predicted so well that rejections would be rare."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.rng = random.Random(5)

    def propose(self, request, max_drafts: int, batch_size: int) -> list[int]:
        drafts = super().propose(request, max_drafts, batch_size)
        if drafts and self.rng.random() < 0.5:
            position = self.rng.randrange(len(drafts))
            drafts[position] = 10 + (drafts[position] + 1) % 4000
        return drafts


class _RowsFree(StepCost):
    """Rows that cost nothing: every draft is proposed, whatever this machine's step times
    (the tests of verification must not depend on them; the cost rule has its own test)."""

    def row_share(self, batch: int) -> float:
        return 0.0


def _with_spec(core, config: dict | None, proposer=NgramProposer):
    """``core`` speculating with ``config`` (None: not speculating), counters from zero."""
    if config is None:
        core.proposer = core.scheduler.proposer = None
    else:
        core.proposer = core.scheduler.proposer = proposer(SpeculativeConfig(config))
        core.proposer.cost = _RowsFree()
    return core


@pytest.fixture(scope="module")
def core(tiny_llama_dir):
    """Chunked prefill in steps of 48 tokens, a KV cache small enough that 24 requests
    preempt each other."""
    return make_core(tiny_llama_dir, num_blocks=32, max_num_batched_tokens=48)


def _mixed_requests(core, stops: dict | None = None) -> dict:
    """Prompts that share a prefix, long ones chunked, n > 1, logprobs; ``stops``: request id
    -> stop string."""
    shared = core.tokenizer.encode("A shared beginning that every request repeats. " * 8)
    rng = random.Random(3)
    requests = {}
    for i in range(32):
        vocab = 4000 if i % 3 else 40  # tokens that repeat: lookups that propose wrong drafts
        tail = [rng.randrange(10, 10 + vocab) for _ in range(rng.randrange(3, 60))]
        params = SamplingParams(temperature=0.0, max_tokens=rng.randrange(30, 60), ignore_eos=True)
        params.stop = [(stops or {}).get(f"r{i}")] if f"r{i}" in (stops or {}) else []
        params.n = 2 if i % 9 == 4 else 1
        if i % 7 == 0:
            params.logprobs = 2
        if i % 11 == 5:
            params.prompt_logprobs = 1
        requests[f"r{i}"] = ((shared if i % 2 else []) + tail, params)
    return requests


def _stops_inside(core, outputs: dict) -> dict:
    """For every third request, a stop string its output (without one) has in the middle."""
    stops = {}
    for rid, output in sorted(outputs.items())[::3]:
        text = core.tokenizer.decode(output.token_ids[:20])
        if len(text.strip()) > 8:
            stops[rid] = text.strip()[-4:]
    return stops


def _tokens(outputs: dict) -> dict:
    return {rid: (o.token_ids, o.text, o.finish_reason) for rid, o in outputs.items()}


@pytest.mark.parametrize("proposer", [NgramProposer, _WrongAtTimes])
def test_greedy_tokens_are_those_without_speculation(core, proposer):
    stops = _stops_inside(core, run_to_completion(_with_spec(core, None), _mixed_requests(core)))
    assert len(stops) >= 5
    plain = run_to_completion(core, _mixed_requests(core, stops))
    assert sum(o.finish_reason is FinishReason.STOP_STRING for o in plain.values()) >= 5
    core.reset_prefix_cache()
    spec = run_to_completion(_with_spec(core, NGRAM, proposer), _mixed_requests(core, stops))
    stats = core.proposer.stats
    assert stats.num_accepted_tokens > 50, "no run of accepted drafts to check"
    if proposer is _WrongAtTimes:  # rejected at every position
        rejected = [stats.num_drafts - stats.accepted_per_pos[0]] + [
            stats.accepted_per_pos[i] - stats.accepted_per_pos[i + 1] for i in range(3)
        ]
        assert min(rejected) > 10, rejected
    assert _tokens(spec) == _tokens(plain)
    for rid, output in spec.items():  # logprobs of every token, accepted runs included
        if output.logprobs is not None:
            assert [lp.token_id for lp in output.logprobs] == output.token_ids
            assert output.logprobs == plain[rid].logprobs
    assert core.kv_manager.num_free_blocks == core.kv_manager.num_blocks  # every block back
    _with_spec(core, None)


def test_greedy_tokens_on_the_triton_backend(tiny_llama_dir):
    """Interpreted Triton: verify rows go through its varlen prefill kernel as a chunk."""
    core = make_core(tiny_llama_dir, num_blocks=32, max_num_batched_tokens=48,
                     attention_backend="triton")  # fmt: skip
    requests = dict(list(_mixed_requests(core).items())[:5])
    for _, params in requests.values():  # interpreted, a token costs a step: 24 of each here
        params.max_tokens = min(params.max_tokens, 24)
    plain = run_to_completion(core, requests)
    spec = run_to_completion(_with_spec(core, NGRAM, _WrongAtTimes), requests)
    stats = core.proposer.stats
    assert stats.num_accepted_tokens > 20 and stats.num_drafts > stats.accepted_per_pos[0]
    assert _tokens(spec) == _tokens(plain)


def test_preemption_prefix_hits_and_chunks_happened(core):
    """What the test above promises to mix: preemptions, prefix hits, chunked prompts."""
    preempted, scheduled = [], []
    original = core.scheduler.schedule

    def spying():
        output = original()
        preempted.extend(output.preempted)
        # (tokens, tokens the request had left): fewer is a prompt's chunk, more a verify
        scheduled.extend((n, r.num_tokens - r.num_computed_tokens) for r, n in output.scheduled)
        return output

    core.scheduler.schedule = spying
    try:
        core.reset_prefix_cache()
        outputs = run_to_completion(_with_spec(core, NGRAM), _mixed_requests(core))
    finally:
        core.scheduler.schedule = original
        _with_spec(core, None)
    assert preempted
    assert any(n < left for n, left in scheduled)  # a prompt's chunk
    assert any(left == 1 < n <= 5 for n, left in scheduled)  # a verify: last token and drafts
    assert any(o.num_cached_tokens for o in outputs.values())


def test_seeded_sampling_draws_the_same_tokens_as_without_speculation(core):
    prompt = core.tokenizer.encode("one two three one two three one two")
    requests = {
        f"s{seed}": (prompt, SamplingParams(temperature=0.8, top_k=5, seed=seed, max_tokens=30))
        for seed in range(8)
    }
    plain = run_to_completion(_with_spec(core, None), requests)
    spec = run_to_completion(_with_spec(core, NGRAM), requests)
    assert core.proposer.stats.num_accepted_tokens > 0
    assert _tokens(spec) == _tokens(plain)
    _with_spec(core, None)


def test_sampled_distribution_is_the_targets(core):
    """A chi-square test of homogeneity (significance 0.001) between the first four tokens of
    600 draws without speculation and 600 with it, other seeds: top_k 3 keeps 81 outcomes."""
    prompt = core.tokenizer.encode("a b a b a b a b")
    draws = 600

    def outcomes(seeds) -> list[tuple]:
        params = [SamplingParams(temperature=1.5, top_k=3, seed=s, max_tokens=4) for s in seeds]
        outputs = run_to_completion(core, {f"d{i}": (prompt, p) for i, p in enumerate(params)})
        return [tuple(outputs[f"d{i}"].token_ids) for i in range(len(params))]

    plain = outcomes(_with_spec(core, None) and range(draws))
    spec = outcomes(_with_spec(core, NGRAM) and range(draws, 2 * draws))
    stats = core.proposer.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    cells = sorted(set(plain) | set(spec))
    table = [[plain.count(c) for c in cells], [spec.count(c) for c in cells]]
    assert chi2_contingency(table).pvalue > 0.001
    _with_spec(core, None)


def test_penalties_bias_and_min_tokens_hold_inside_accepted_runs(core):
    """Rules that depend on the output so far: a run of accepted drafts sees each earlier one."""
    prompt = core.tokenizer.encode("x y z x y z x y z x y z")
    eos = next(iter(core.eos_token_ids))
    params = [
        SamplingParams(temperature=0.0, max_tokens=40, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, max_tokens=40, frequency_penalty=1.0),
        SamplingParams(temperature=0.0, max_tokens=40, logit_bias={eos: 30.0}, min_tokens=12),
        SamplingParams(temperature=0.0, max_tokens=40, bad_words=["x y"]),
    ]
    requests = {f"p{i}": (prompt, p) for i, p in enumerate(params)}
    plain = run_to_completion(_with_spec(core, None), requests)
    spec = run_to_completion(_with_spec(core, NGRAM, _WrongAtTimes), requests)
    assert core.proposer.stats.num_accepted_tokens > 0
    assert _tokens(spec) == _tokens(plain)
    assert spec["p2"].finish_reason is FinishReason.EOS
    assert len(spec["p2"].token_ids) == 13  # min_tokens, then the biased EOS
    _with_spec(core, None)


def test_a_fault_inside_an_accepted_run_ends_that_request_alone(core, monkeypatch):
    """The sampler fails for one request at its 5th token, which comes after accepted drafts:
    it ends with an error, the rest of its batch carries on with the tokens it would have had."""
    from llmrpc.engine.sample import sampler as sampler_module

    prompt = core.tokenizer.encode("red green blue red green blue red green blue red")
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    requests = {name: (prompt, params) for name in ("a", "b", "bad", "c")}
    clean = run_to_completion(_with_spec(core, NGRAM, _WrongAtTimes), requests)
    original = sampler_module.apply_logits_processors

    def failing(logits, batch):
        if any(r.request_id == "bad" and r.num_output_tokens == 4 for r in batch):
            raise RuntimeError("injected fault for bad")
        return original(logits, batch)

    monkeypatch.setattr(sampler_module, "apply_logits_processors", failing)
    outputs = run_to_completion(_with_spec(core, NGRAM, _WrongAtTimes), requests)
    assert outputs["bad"].finish_reason is FinishReason.ERROR
    assert "injected fault for bad" in outputs["bad"].error
    assert core.proposer.stats.accepted_per_pos[2] > 0  # runs of accepted drafts happened
    for name in ("a", "b", "c"):
        assert outputs[name].token_ids == clean[name].token_ids
    assert core.kv_manager.num_free_blocks == core.kv_manager.num_blocks
    _with_spec(core, None)


def test_structured_output_validates_under_speculation(core):
    schema = {"type": "array", "items": {"enum": ["ab", "ab ab"]}, "minItems": 2, "maxItems": 6}
    spec = structured_output.check(
        StructuredOutputSpec("json_schema", json.dumps(schema), any_whitespace=False), "xgrammar"
    )
    prompt = core.tokenizer.encode('["ab", "ab", "ab", "ab ab", "ab", "ab"]')
    params = [SamplingParams(seed=s, max_tokens=80, structured_output=spec) for s in range(12)]
    requests = {f"j{i}": (prompt, p) for i, p in enumerate(params)}
    outputs = run_to_completion(_with_spec(core, NGRAM), requests)
    assert core.proposer.stats.num_accepted_tokens > 0
    for output in outputs.values():
        assert output.finish_reason is FinishReason.EOS, output.text
        jsonschema.validate(json.loads(output.text), schema)
    _with_spec(core, None)


def test_lookup_takes_the_latest_of_the_longest_match():
    import numpy as np

    tokens = np.array([1, 2, 3, 9, 5, 2, 3, 7, 8, 1, 2, 3])
    assert lookup(tokens, 1, 3, 2) == [9, 5]  # "1 2 3" once before: what followed it
    assert lookup(tokens, 1, 2, 3) == [7, 8, 1]  # "2 3": the latest occurrence wins
    assert lookup(tokens, 1, 2, 6) == [9, 5, 2, 3, 7, 8]  # the latest with 6 after: the first
    assert lookup(tokens, 4, 4, 2) == []  # no 4-token match
    loop = np.array([4, 4, 4, 4, 4, 4])
    assert lookup(loop, 1, 2, 3) == [4, 4, 4]  # not the latest "4 4", followed by one token
    assert lookup(loop, 1, 2, 8) == [4, 4, 4, 4]  # none has 8 after: the earliest, to the end


def _request(tokens: list[int], request_id: str = "r"):
    return types.SimpleNamespace(request_id=request_id, all_token_ids=tokens,
                                 num_tokens=len(tokens))  # fmt: skip


def test_proposals_back_off_after_misses_and_stop_at_the_batch_size_and_length_limits():
    config = {**NGRAM, "disable_by_batch_size": 8, "max_model_len": 12}
    proposer = NgramProposer(SpeculativeConfig(config))
    request = _request([1, 2, 3, 1, 2])
    assert proposer.propose(request, 4, batch_size=7) == [3, 1, 2]
    assert proposer.propose(request, 4, batch_size=8) == []  # disable_by_batch_size
    assert proposer.propose(request, 2, batch_size=1) == [3, 1]  # the scheduler's limit
    assert proposer.propose(_request([1, 2] * 5 + [1], "s"), 4, 1) == [2]  # 11 tokens: 1 to 12
    skipped = []
    for _ in range(4):  # no draft accepted: 1, 2, 4, then 8 steps without proposals
        proposer.verified(request, 3, 0)
        waited = 0
        while not proposer.propose(request, 4, batch_size=1):
            waited += 1
        skipped.append(waited)
    assert skipped == [1, 2, 4, 8]
    proposer.verified(request, 3, 1)  # an accepted draft: the next miss waits 1 step again
    proposer.verified(request, 3, 0)
    assert proposer.propose(request, 4, 1) == [] and proposer.propose(request, 4, 1)
    counts = proposer.stats.counts()
    assert (counts.num_drafts, counts.num_draft_tokens, counts.num_accepted_tokens) == (6, 18, 1)
    assert counts.accepted_per_pos == (1, 0, 0, 0)


def test_drafts_are_cut_to_those_worth_their_rows():
    """Steps of 10 ms plus 1 ms a row: at batch 1 a row costs 1/11 of what a token is worth,
    at batch 30 three quarters. A request whose drafts were all rejected once (acceptance
    estimate 2/3) proposes 4 drafts alone (p^4 = 0.2 >= 0.09) and none in the batch of 30;
    one whose drafts keep being accepted still proposes there."""
    proposer = NgramProposer(SpeculativeConfig(NGRAM))
    for rows in [1, 5, 2, 8, 3, 40, 12, 30, 7, 4]:
        proposer.cost.add(rows, 0.010 + 0.001 * rows)
    assert proposer.cost.row_share(1) == pytest.approx(1 / 11)
    assert proposer.cost.row_share(30) == pytest.approx(0.75)
    missing, taking = _request([1, 2, 3, 1, 2] * 3, "m"), _request([4, 5, 6, 4, 5] * 3, "t")
    assert proposer.propose(missing, 4, 1) == [1, 2, 3, 1]  # a fresh request: estimate 1
    proposer.verified(missing, 4, 0)
    proposer.propose(missing, 4, 1)  # the one step its miss skips
    assert len(proposer.propose(missing, 4, 1)) == 4
    assert proposer.propose(missing, 4, 30) == []
    for _ in range(5):
        proposer.propose(taking, 4, 30)
        proposer.verified(taking, 4, 4)
    assert len(proposer.propose(taking, 4, 30)) == 4


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"method": "eagle", "num_speculative_tokens": 3}, "method 'eagle' needs EAGLE"),
        ({"method": "draft_model", "num_speculative_tokens": 3}, "draft_model needs model"),
        (
            {"model": "some/draft", "num_speculative_tokens": 3, "prompt_lookup_min": 2},
            "'prompt_lookup_min' is not used by method draft_model",
        ),
        (
            {"model": "some/draft", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 2},
            "draft_tensor_parallel_size 2",
        ),
        ({"method": "ngram"}, "num_speculative_tokens is required"),
        ({"method": "ngram", "num_speculative_tokens": 3, "quantization": "fp8"}, "'quantization'"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "must be an integer >= 1"),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 4,
                "prompt_lookup_max": 2,
            },
            "must not exceed",
        ),  # fmt: skip
        ({"method": "lookahead", "num_speculative_tokens": 2}, "unknown method 'lookahead'"),
    ],
)
def test_config_refusals_name_what_is_wrong(config, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig(config)


def test_config_defaults_as_vllm():
    config = SpeculativeConfig({"model": "[ngram]", "num_speculative_tokens": 3})
    assert (config.method, config.prompt_lookup_min, config.prompt_lookup_max) == ("ngram", 5, 5)
    config = SpeculativeConfig({"method": "ngram", "num_speculative_tokens": 3,
                                "prompt_lookup_max": 4})  # fmt: skip
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (4, 4)


def test_combinations_this_build_refuses():
    speculative = SpeculativeConfig(NGRAM)
    engine = EngineConfig(speculative=speculative)
    model = dataclasses.replace(engine.model, batch_invariant=True)
    with pytest.raises(ValueError, match="refused with --batch-invariant"):
        EngineConfig(speculative=speculative, model=model)


def test_engines_counts_add_up_position_by_position():
    """--data-parallel-size: GetLoad's counts are the engines' added up, whatever their lengths."""
    from llmrpc.engine.core_types import SpecDecodeCounts

    total = SpecDecodeCounts(1, 4, 2, (2, 0)) + SpecDecodeCounts(2, 6, 3, (2, 1, 0))
    assert total == SpecDecodeCounts(3, 10, 5, (4, 1, 0))


# --- method draft_model ----------------------------------------------------------------------

DRAFT_SIZES = {  # the draft: the served tiny model's own weights, or a smaller random model
    "same-weights": None,
    "smaller": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "seed": 1},
}


@pytest.fixture(scope="module")
def draft_dirs(tiny_llama_dir, tiny_model_factory) -> dict:
    return {"same-weights": tiny_llama_dir, "smaller": tiny_model_factory(**DRAFT_SIZES["smaller"])}


def _draft_core(target_dir, draft_dir, **options):
    """An engine whose draft is ``draft_dir``, every draft proposed (rows cost nothing)."""
    config = {"model": str(draft_dir), "num_speculative_tokens": 4}
    options = {"num_blocks": 32, "max_num_batched_tokens": 48, **options}
    core = make_core(target_dir, speculative=config, **options)
    core.proposer.cost = _RowsFree()
    return core


def _wrong_at_times(proposer) -> None:
    """One draft of every other proposal made wrong, at a random position (the draft's cache
    keeps its own token there, which the target's next tokens then contradict)."""
    rng, propose = random.Random(5), proposer.propose

    def wrong(request, max_drafts, batch_size):
        drafts = propose(request, max_drafts, batch_size)
        if drafts and rng.random() < 0.5:
            position = rng.randrange(len(drafts))
            drafts[position] = 10 + (drafts[position] + 1) % 4000
        return drafts

    proposer.propose = wrong


@pytest.mark.parametrize("wrong", [False, True], ids=["as-proposed", "wrong-at-times"])
@pytest.mark.parametrize("draft", list(DRAFT_SIZES))
def test_draft_model_greedy_tokens_are_those_without_speculation(core, draft_dirs, draft, wrong):
    """The mixed batch (chunks, prefix hits, preemptions, stop strings, n > 1, logprobs) with a
    draft model: the served model's own weights as the draft propose what it then samples, so
    in float32 nearly every draft is accepted, which only holds if the draft's cache is caught
    up and rolled back right."""
    stops = _stops_inside(core, run_to_completion(_with_spec(core, None), _mixed_requests(core)))
    plain = run_to_completion(core, _mixed_requests(core, stops))
    spec_core = _draft_core(core.model_dir, draft_dirs[draft])
    if wrong:
        _wrong_at_times(spec_core.proposer)
    preempted, schedule = [], spec_core.scheduler.schedule
    spec_core.scheduler.schedule = lambda: (out := schedule(), preempted.extend(out.preempted))[0]
    spec = run_to_completion(spec_core, _mixed_requests(core, stops))
    assert preempted and any(o.num_cached_tokens for o in spec.values())
    stats = spec_core.proposer.stats
    assert stats.num_accepted_tokens > 50, "no run of accepted drafts to check"
    if draft == "same-weights" and not wrong:
        assert stats.num_accepted_tokens >= 0.99 * stats.num_draft_tokens
    else:
        assert stats.num_accepted_tokens < stats.num_draft_tokens
    assert _tokens(spec) == _tokens(plain)
    for rid, output in spec.items():
        if output.logprobs is not None:
            assert output.logprobs == plain[rid].logprobs
    for manager in (spec_core.kv_manager, spec_core.proposer.kv_manager):  # every block back
        assert manager.num_free_blocks == manager.num_blocks


def test_draft_model_on_the_triton_backend(tiny_llama_dir, draft_dirs):
    """Interpreted Triton, the draft's passes through its kernels too."""
    core = make_core(tiny_llama_dir, num_blocks=32, max_num_batched_tokens=48,
                     attention_backend="triton")  # fmt: skip
    requests = dict(list(_mixed_requests(core).items())[:4])
    for _, params in requests.values():
        params.max_tokens = 16
    plain = run_to_completion(core, requests)
    spec_core = _draft_core(tiny_llama_dir, draft_dirs["smaller"], attention_backend="triton")
    _wrong_at_times(spec_core.proposer)
    spec = run_to_completion(spec_core, requests)
    stats = spec_core.proposer.stats
    assert stats.num_accepted_tokens > 10 and stats.num_drafts > stats.accepted_per_pos[0]
    assert _tokens(spec) == _tokens(plain)


def test_draft_model_seeded_sampling_draws_the_same_tokens_as_without_speculation(core, draft_dirs):
    prompt = core.tokenizer.encode("one two three one two three one two")
    requests = {
        f"s{seed}": (prompt, SamplingParams(temperature=0.8, top_k=5, seed=seed, max_tokens=30))
        for seed in range(8)
    }
    plain = run_to_completion(_with_spec(core, None), requests)
    spec_core = _draft_core(core.model_dir, draft_dirs["same-weights"])
    spec = run_to_completion(spec_core, requests)
    stats = spec_core.proposer.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert _tokens(spec) == _tokens(plain)


def test_draft_model_sampled_distribution_is_the_targets(core, draft_dirs):
    """As for ngram: chi-square (significance 0.001) over the first four tokens of 600 draws
    each way; the draft proposes its most likely tokens, which the target accepts at times."""
    prompt = core.tokenizer.encode("a b a b a b a b")
    draws = 600

    def outcomes(engine, seeds) -> list[tuple]:
        params = [SamplingParams(temperature=1.5, top_k=3, seed=s, max_tokens=4) for s in seeds]
        outputs = run_to_completion(engine, {f"d{i}": (prompt, p) for i, p in enumerate(params)})
        return [tuple(outputs[f"d{i}"].token_ids) for i in range(len(params))]

    plain = outcomes(_with_spec(core, None), range(draws))
    spec_core = _draft_core(core.model_dir, draft_dirs["same-weights"], num_blocks=256,
                            max_num_batched_tokens=512)  # fmt: skip
    spec = outcomes(spec_core, range(draws, 2 * draws))
    stats = spec_core.proposer.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    cells = sorted(set(plain) | set(spec))
    table = [[plain.count(c) for c in cells], [spec.count(c) for c in cells]]
    assert chi2_contingency(table).pvalue > 0.001


def test_structured_output_holds_with_a_draft_model(core, draft_dirs):
    """A choice between the text the model writes unconstrained, which the draft (its own
    weights) proposes and the target accepts, and another: every output is one of the two."""
    prompt = core.tokenizer.encode("red green blue red green blue")
    free = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    written = run_to_completion(_with_spec(core, None), {"free": (prompt, free)})["free"].text
    choices = (written, "no")
    spec = structured_output.check(StructuredOutputSpec("choice", choices=choices), "xgrammar")
    params = [SamplingParams(seed=s, max_tokens=30, structured_output=spec) for s in range(12)]
    params.append(SamplingParams(temperature=0.0, max_tokens=30, structured_output=spec))
    spec_core = _draft_core(core.model_dir, draft_dirs["same-weights"])
    outputs = run_to_completion(spec_core, {f"j{i}": (prompt, p) for i, p in enumerate(params)})
    assert spec_core.proposer.stats.num_accepted_tokens > 5
    assert outputs["j12"].text == written
    for output in outputs.values():
        assert output.finish_reason is FinishReason.EOS, output.text
        assert output.text in choices


def test_a_draft_with_another_tokenizer_is_refused(tiny_llama_dir, tmp_path):
    """The tiny model's folder with two tokens' ids swapped in its tokenizer."""
    import shutil

    draft = tmp_path / "other-tokenizer"
    shutil.copytree(tiny_llama_dir, draft)
    tokenizer = json.loads((draft / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab["hello"], vocab["world"] = vocab["world"], vocab["hello"]
    (draft / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ValueError, match="another tokenizer than the served model: 2 token"):
        _draft_core(tiny_llama_dir, draft)


def test_a_draft_model_sleeps_and_wakes_with_the_engine(tiny_llama_dir, draft_dirs):
    """Sleep level 2 drops the draft's weights and KV cache too; awake, it proposes again."""
    core = _draft_core(tiny_llama_dir, draft_dirs["same-weights"])
    object.__setattr__(core.model_config, "enable_sleep_mode", True)
    requests = dict(list(_mixed_requests(core).items())[:4])
    before = run_to_completion(core, requests)
    core.sleep(2)
    assert core.proposer.runner.model is None and not core.proposer.runner.kv_caches
    core.wake_up()
    accepted = core.proposer.stats.num_accepted_tokens
    assert _tokens(run_to_completion(core, requests)) == _tokens(before)
    assert core.proposer.stats.num_accepted_tokens > accepted


def test_a_draft_model_runs_only_while_the_scheduler_takes_drafts(tiny_llama_dir, draft_dirs):
    """``bench throughput --baseline free`` turns proposals off on the same engine: the draft
    must not run then (its passes would be charged to the side without speculation)."""
    core = _draft_core(tiny_llama_dir, draft_dirs["smaller"])
    runner, passes = core.proposer.runner, []
    execute = runner.execute
    runner.execute = lambda *args: passes.append(1) or execute(*args)
    requests = dict(list(_mixed_requests(core).items())[:2])
    proposer, core.scheduler.proposer = core.scheduler.proposer, None
    run_to_completion(core, requests)
    assert not passes
    core.scheduler.proposer = proposer
    run_to_completion(core, requests)
    assert passes
