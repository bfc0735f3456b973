"""Incremental detokenization and stop conditions: no leaked stop strings, exact endings."""

from __future__ import annotations

import pytest
from engine_utils import make_core, run_to_completion

from llmrpc.engine.loading.loader import load_tokenizer
from llmrpc.engine.output.detokenizer import IncrementalDetokenizer
from llmrpc.engine.request import FinishReason, SamplingParams


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return load_tokenizer(smollm2_dir)


def stream(detokenizer: IncrementalDetokenizer, token_ids: list[int]) -> tuple[list[str], str]:
    """Feed tokens one by one as the engine does; returns the deltas and the stop matched."""
    deltas = []
    for token_id in token_ids:
        stop = detokenizer.add_token(token_id)
        deltas.append(detokenizer.take_delta(finished=stop is not None))
        if stop is not None:
            return deltas, stop
    deltas.append(detokenizer.take_delta(finished=True))
    return deltas, None


def test_incremental_text_equals_a_full_decode(tokenizer):
    text = " Grüße aus Köln 🙂 — naïve café, 東京タワー!"
    ids = tokenizer.encode(text, add_special_tokens=False)
    prompt = tokenizer.encode("Say hello:", add_special_tokens=False)
    deltas, _ = stream(IncrementalDetokenizer(tokenizer, prompt), ids)
    assert "".join(deltas) == tokenizer.decode(ids)
    assert not any("\ufffd" in d for d in deltas)  # never half a character


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_tokens_is_cut_and_never_streamed(tokenizer, include):
    text = " The lighthouse keeper climbed the stairs every evening."
    ids = tokenizer.encode(text, add_special_tokens=False)
    stop = "keeper climbed"
    assert len(tokenizer.encode(stop, add_special_tokens=False)) > 1  # spans several tokens
    detokenizer = IncrementalDetokenizer(tokenizer, [], [stop], include_stop_str_in_output=include)
    deltas, matched = stream(detokenizer, ids)
    assert matched == stop
    expected = " The lighthouse " + (stop if include else "")
    assert "".join(deltas) == expected
    streamed_before_end = "".join(deltas[:-1])
    assert "keeper" not in streamed_before_end  # the beginning of the stop was held back


def test_earliest_of_several_stop_strings_wins(tokenizer):
    ids = tokenizer.encode(" alpha beta gamma", add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer, [], ["gamma", "beta gam"])
    deltas, matched = stream(detokenizer, ids)
    assert matched == "beta gam"
    assert "".join(deltas) == " alpha "


@pytest.fixture(scope="module")
def core(tiny_llama_dir):
    return make_core(tiny_llama_dir)


def _greedy(max_tokens=24, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def test_engine_stops_on_a_stop_token_and_on_max_tokens(core):
    prompt = core.tokenizer.encode("Count with me: one, two")
    free = run_to_completion(core, {"free": (prompt, _greedy())})["free"]
    assert free.finish_reason is FinishReason.LENGTH and len(free.token_ids) == 24
    stop_token = free.token_ids[5]
    first = free.token_ids.index(stop_token)
    out = run_to_completion(core, {"s": (prompt, _greedy(stop_token_ids=[stop_token]))})["s"]
    assert out.finish_reason is FinishReason.STOP_TOKEN
    assert out.stop_reason == stop_token
    assert out.token_ids == free.token_ids[: first + 1]


def test_engine_stop_string_ends_output_in_the_middle_of_a_token_run(core):
    prompt = core.tokenizer.encode("Write something")
    free = run_to_completion(core, {"free": (prompt, _greedy())})["free"]
    text = free.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop and stop in text
    core.add_request("s", prompt, _greedy(stop=[stop]))
    deltas, final = [], None
    while core.has_unfinished_requests:
        for output in core.step():
            deltas.append(output.text)
            final = output
    assert final.finish_reason is FinishReason.STOP_STRING and final.stop_reason == stop
    assert "".join(deltas) == text[: text.index(stop)]
    assert core.kv_manager.num_free_blocks == core.kv_manager.num_blocks


def test_eos_ends_generation_without_text_unless_ignored(core):
    prompt = core.tokenizer.encode("Hello")
    free = run_to_completion(core, {"free": (prompt, _greedy(8))})["free"]
    eos_like = free.token_ids[2]
    real_eos = core.input_processor.eos_token_ids
    core.input_processor.eos_token_ids = frozenset({eos_like})  # pretend it is the model's EOS
    try:
        params = SamplingParams(temperature=0.0, max_tokens=8)
        out = run_to_completion(core, {"e": (prompt, params)})["e"]
    finally:
        core.input_processor.eos_token_ids = real_eos
    assert out.finish_reason is FinishReason.EOS and out.stop_reason == eos_like
    assert out.token_ids == free.token_ids[: free.token_ids.index(eos_like) + 1]


@pytest.mark.parametrize(
    ("spaces", "expected"),
    # As slow tokenizers join: every piece, text or special token, with one space.
    [(True, " Hi <|im_end|> <|im_start|>  yo"), (False, " Hi<|im_end|><|im_start|> yo")],
)
def test_spaces_between_kept_special_tokens(tokenizer, spaces, expected):
    ids = tokenizer.encode(" Hi<|im_end|><|im_start|> yo", add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(
        tokenizer, [], skip_special_tokens=False, spaces_between_special_tokens=spaces
    )
    deltas, _ = stream(detokenizer, ids)
    assert "".join(deltas) == expected
