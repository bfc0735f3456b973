"""Request and server options: deadlines, generation config, config overrides, no tokenizer."""

from __future__ import annotations

import json
import time

import pytest
from engine_utils import make_core, run_to_completion

from llmrpc.engine.config import CacheConfig, EngineConfig, ModelConfig
from llmrpc.engine.core.engine_core import EngineCore
from llmrpc.engine.loading.generation_config import sampling_defaults
from llmrpc.engine.request import FinishReason, InvalidRequestError, SamplingParams


def test_queued_request_that_cannot_meet_its_deadline_is_dropped_early(tiny_llama_dir):
    core = make_core(tiny_llama_dir, num_blocks=256, max_num_seqs=1)
    run_to_completion(core, {"warm": ([5] * 300, SamplingParams(max_tokens=2))})  # learn the pace
    core.add_request("busy", [7] * 100, SamplingParams(max_tokens=400, ignore_eos=True))
    core.step()
    # Queued behind "busy" (max_num_seqs=1) with a deadline a millisecond away.
    hopeless = SamplingParams(max_tokens=4, deadline=time.monotonic() + 0.001)
    core.add_request("hopeless", [9] * 400, hopeless)
    generous = SamplingParams(max_tokens=4, deadline=time.monotonic() + 3600)
    core.add_request("generous", [11] * 20, generous)
    outputs = core.step()
    dropped = [o for o in outputs if o.request_id == "hopeless"]
    assert dropped and dropped[0].finish_reason is FinishReason.DEADLINE
    assert dropped[0].num_output_tokens == 0
    assert "generous" in core.scheduler.requests  # still queued, not dropped
    core.abort_requests(["busy", "generous"])


def test_the_packaged_model_samples_as_its_model_card_unless_told_otherwise(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert sampling_defaults("auto", tmp_path, packaged=True) == {"temperature": 0.2, "top_p": 0.9}
    assert sampling_defaults("auto", tmp_path) == {}  # a model given by path: its own file only
    assert sampling_defaults("vllm", tmp_path, packaged=True) == {}  # vLLM's built-in defaults
    overridden = sampling_defaults("auto", tmp_path, {"temperature": 0.0}, packaged=True)
    assert overridden == {"temperature": 0.0, "top_p": 0.9}


def test_generation_config_supplies_defaults_and_overrides_win(tmp_path):
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.6, "top_p": 0.9, "max_new_tokens": 64, "do_sample": True})
    )
    assert sampling_defaults("auto", tmp_path) == {
        "temperature": 0.6,
        "top_p": 0.9,
        "max_tokens": 64,
    }
    assert sampling_defaults("vllm", tmp_path) == {}
    assert sampling_defaults("auto", tmp_path, {"temperature": 0.1})["temperature"] == 0.1
    with pytest.raises(ValueError, match="--override-generation-config"):
        sampling_defaults("auto", tmp_path, {"temprature": 0.1})
    with pytest.raises(ValueError, match="--generation-config"):
        sampling_defaults(str(tmp_path / "missing"), tmp_path)


def _core(model_dir, **model_options) -> EngineCore:
    return EngineCore(
        EngineConfig(
            model=ModelConfig(str(model_dir), dtype="float32", **model_options),
            cache=CacheConfig(num_gpu_blocks_override=64),
        )
    )


def test_hf_overrides_rope_theta_and_rope_scaling_reach_the_model(tiny_llama_dir):
    core = _core(
        tiny_llama_dir,
        hf_overrides={"rms_norm_eps": 1e-3},
        rope_theta=123456.0,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
    )
    assert core.model.norm.eps == 1e-3
    default = _core(tiny_llama_dir).model.rotary.inv_freq
    inv_freq = core.model.rotary.inv_freq
    assert inv_freq[1] == pytest.approx(1 / 123456.0 ** (2 / 16) / 2.0, rel=1e-5)
    assert not (inv_freq == default).all()


def test_skip_tokenizer_init_gives_token_ids_only(tiny_llama_dir):
    core = _core(tiny_llama_dir, skip_tokenizer_init=True)
    assert core.tokenizer is None
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    out = run_to_completion(core, {"ids": ([5, 6, 7], params)})["ids"]
    assert len(out.token_ids) == 5 and out.text == ""
    with pytest.raises(InvalidRequestError) as error:
        core.add_request("stops", [5], SamplingParams(stop=["x"]))
    assert error.value.field == "stop"


def test_without_chunked_prefill_a_whole_prompt_must_fit_one_step(tiny_llama_dir):
    with pytest.raises(ValueError, match="--max-num-batched-tokens"):
        make_core(tiny_llama_dir, max_num_batched_tokens=64, enable_chunked_prefill=False)
    core = make_core(
        tiny_llama_dir, max_model_len=128, max_num_batched_tokens=128, enable_chunked_prefill=False
    )
    core.add_request("a", [5] * 100, SamplingParams(max_tokens=2))
    core.add_request("b", [6] * 100, SamplingParams(max_tokens=2))
    # b does not fit in what is left of the step, and may not be cut: it waits.
    assert [(r.request_id, n) for r, n in core.scheduler.schedule().scheduled] == [("a", 100)]


def test_a_sliding_window_bounds_the_context_where_it_is_not_served(tmp_path, smollm2_dir):
    """The native model attends within its window over its whole context;
    --disable-sliding-window caps the context at the window."""
    from tiny_models import TINY_DECODER, save_tiny_model

    model_dir = save_tiny_model(
        tmp_path / "m", smollm2_dir, "mistral", **{**TINY_DECODER, "sliding_window": 64}
    )
    assert make_core(model_dir, max_model_len=None).max_model_len == 512
    assert make_core(model_dir, max_model_len=None, attention_backend="triton").max_model_len == 512
    capped = make_core(model_dir, max_model_len=None, disable_sliding_window=True)
    assert capped.max_model_len == 64
    with pytest.raises(ValueError, match="attention window"):
        make_core(model_dir, max_model_len=128, disable_sliding_window=True)
