"""Attention plans forced in tests: ``attention_tuning.choose`` made to give one stage's buckets
set paths, whatever the timing said."""

from __future__ import annotations

import dataclasses

from llmrpc.kernels import attention_tuning


def forced_choice(stage: str, kernels: tuple[str, ...]):
    """``attention_tuning.choose`` (as it is now) giving ``stage``'s buckets ``kernels`` where
    each is one of the shape's candidates, and the rest what was timed."""
    choose = attention_tuning.choose

    def forced(choice_stage, shape, num_layers, times):
        choice = choose(choice_stage, shape, num_layers, times)
        if choice_stage != stage or not set(kernels) <= set(times):
            return choice
        return dataclasses.replace(choice, kernels=kernels)

    return forced
