"""A long prompt chunked at 256 tokens gives the unchunked run's greedy tokens with the device
slowed far behind the host (marked ``gpu``; on the CPU only in the device check's dry run).

Steps of non-final prompt chunks sample nothing and read nothing back, so nothing but the pinned
staging's own events keeps the host from refilling a step's ``slot_mapping`` and ``positions``
before the device has copied the previous step's: KV at wrong slots, other tokens, no error."""

from __future__ import annotations

import pytest
import torch
from device_target import DEVICE, ON_DEVICE
from engine_utils import make_core, run_to_completion

from llmrpc.engine.request import SamplingParams

pytestmark = ON_DEVICE

PROMPT_LEN, CHUNK = (4096, 256) if DEVICE == "cuda" else (160, 32)
SLEEP_CYCLES = 20_000_000  # about 10 ms of an H200's 1.98 GHz clock, per forward


def _tokens(model_dir, max_num_batched_tokens: int, slow: bool) -> list[int]:
    core = make_core(
        model_dir,
        device=DEVICE,
        attention_backend="triton",
        max_model_len=PROMPT_LEN + 64,
        num_blocks=(PROMPT_LEN + 64) // 16 + 8,
        max_num_batched_tokens=max_num_batched_tokens,
    )
    if slow and DEVICE == "cuda":
        model = core.runner.model
        forward = model.forward

        def slowed(*args, **kwargs):
            torch.cuda._sleep(SLEEP_CYCLES)  # the device falls behind; the host runs on
            return forward(*args, **kwargs)

        model.forward = slowed
    prompt = [(31 * j) % 20000 + 100 for j in range(PROMPT_LEN)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    return run_to_completion(core, {"long": (prompt, params)})["long"].token_ids


@pytest.mark.timeout(300)
def test_a_chunked_prompt_on_a_slowed_device_gives_the_unchunked_tokens(smollm2_dir):
    expected = _tokens(smollm2_dir, PROMPT_LEN + 64, slow=False)
    assert _tokens(smollm2_dir, CHUNK, slow=True) == expected
