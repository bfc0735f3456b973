"""Bounds on one REST request's fan-out (``llmrpc.common.fanout``), in OpenAI's terms: checked
before any call is made for it, so a refused request costs the server nothing."""

from __future__ import annotations

from llmrpc.gateway.errors import invalid
from llmrpc.gateway.settings import ApiSettings


def check_prompts(api: ApiSettings, num_prompts: int, param: str) -> None:
    """A 400 naming ``param`` (``prompt``, ``input``) past --max-prompts-per-request."""
    if num_prompts > api.max_prompts_per_request:
        raise invalid(
            param,
            f"{param}: at most {api.max_prompts_per_request} prompts per request on this server "
            f"(--max-prompts-per-request), got {num_prompts}",
        )


def check_sequences(api: ApiSettings, num_prompts: int, n: int, prompt_param: str) -> None:
    """A 400 past --max-sequences-per-request (prompts x n), naming ``n`` for one prompt,
    else the prompts' parameter."""
    num_sequences = num_prompts * n
    if num_sequences <= api.max_sequences_per_request:
        return
    param = "n" if num_prompts == 1 else prompt_param
    shape = f"n={n}" if num_prompts == 1 else f"{num_prompts} prompts x n={n}"
    raise invalid(
        param,
        f"{param}: {shape} is {num_sequences} sequences; at most "
        f"{api.max_sequences_per_request} per request on this server "
        "(--max-sequences-per-request)",
    )
