"""The structured-output part of an engine step.

The token bitmask of each constrained request that samples this step depends only on the tokens
it has already accepted, so it is written on a worker thread while the forward pass runs
(``start``), then turned into one ``[vocab_size]`` bool mask per request on the logits' device
(``finish``), which the logits processors apply as a hard constraint. After sampling,
``advance`` moves each matcher on by its new token.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass

import torch

from llmrpc.engine.request import InvalidRequestError, Request
from llmrpc.engine.structured_output.grammar import field_name

_BITS = torch.arange(32, dtype=torch.int32)


def allocate_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """``[num_rows, ceil(vocab_size / 32)]`` int32, every bit set (every token allowed)."""
    return torch.full((num_rows, -(-vocab_size // 32)), -1, dtype=torch.int32)


def bitmask_to_bool(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[rows, words]`` int32 bitmask -> ``[rows, vocab_size]`` bool, True where allowed."""
    bits = (bitmask.unsqueeze(-1) >> _BITS.to(bitmask.device)) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


@dataclass
class PendingMasks:
    requests: list[Request]
    bitmask: torch.Tensor  # [len(requests), words] int32
    errors: dict[Request, str | InvalidRequestError]  # an InvalidRequestError: the caller's
    done: concurrent.futures.Future


@torch.inference_mode()  # as the step that made the bitmask
def _fill(requests: list[Request], bitmask: torch.Tensor, errors: dict) -> None:
    for row, request in enumerate(requests):
        try:
            request.grammar.fill(bitmask, row)
        except Exception as error:  # noqa: BLE001 - this request's own fault
            errors[request] = f"computing the structured output's token mask failed: {error!r}"
            continue
        if not bitmask[row].any():  # no token, not even a stop token, may come next
            errors[request] = _dead_end(request)


def _dead_end(request: Request) -> InvalidRequestError:
    """The error of a constraint that admits nothing after the output so far: the caller's
    (a schema that only refers to itself, or whose every branch is impossible)."""
    where = f"after {request.num_output_tokens} output tokens"
    message = f"admits no output ({where} no token can follow): it can never be satisfied"
    return InvalidRequestError(field_name(request.grammar.spec), message)


def _samples(request: Request, num_scheduled: int) -> bool:
    grammar = request.grammar
    active = grammar is not None and grammar.active
    return active and request.num_computed_tokens + num_scheduled >= request.num_tokens


class GrammarStep:
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="token-mask")

    def start(self, scheduled: list[tuple[Request, int]]) -> PendingMasks | None:
        """Begin the masks of the constrained requests that will sample this step."""
        requests = [request for request, num in scheduled if _samples(request, num)]
        if not requests:
            return None
        bitmask = allocate_bitmask(len(requests), self.vocab_size)
        errors: dict[Request, str | InvalidRequestError] = {}
        done = self._pool.submit(_fill, requests, bitmask, errors)
        return PendingMasks(requests, bitmask, errors, done)

    def finish(self, pending: PendingMasks | None, device: torch.device, failed: dict) -> None:
        """Wait for the masks and give each request its own (``request.grammar_mask``)."""
        if pending is None:
            return
        pending.done.result()
        failed.update(pending.errors)
        masks = bitmask_to_bool(pending.bitmask.to(device, non_blocking=True), self.vocab_size)
        for row, request in enumerate(pending.requests):
            request.grammar_mask = masks[row]

    def masks_now(self, requests: list[Request], device: torch.device, failed: dict) -> None:
        """The masks of ``requests`` computed here and now (the row after an accepted draft:
        its grammar has just taken the draft)."""
        bitmask = allocate_bitmask(len(requests), self.vocab_size)
        errors: dict[Request, str | InvalidRequestError] = {}
        _fill(requests, bitmask, errors)
        done: concurrent.futures.Future = concurrent.futures.Future()
        done.set_result(None)
        self.finish(PendingMasks(requests, bitmask, errors, done), device, failed)

    def advance(self, sampled: list[Request], updated: list[Request], failed: dict) -> None:
        """Feed each constrained request's new token to its matcher; a token the grammar
        refuses fails its request (``failed``)."""
        for request in sampled:
            request.grammar_mask = None
        for request in updated:
            if request.grammar is not None and request not in failed:
                try:
                    error = request.grammar.accept(request.output_token_ids)
                except Exception as exc:  # noqa: BLE001 - this request's own fault
                    error = f"advancing the structured output failed: {exc!r}"
                if error is not None:
                    failed[request] = error
