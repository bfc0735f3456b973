"""OpenAI response bodies, built as dicts from the gRPC client's results.

Finish reasons: a stop string, stop token or EOS is "stop"; max_tokens, the context window and
the time limit are "length"; "abort" when the request was aborted. ``stop_reason`` (vLLM's
extension) is the matched stop string or token id.
"""

from __future__ import annotations

from llmrpc.clients import FinishReason, TokenLogprob, Usage

_FINISH_REASONS = {
    FinishReason.LENGTH: "length",
    FinishReason.TIME_LIMIT: "length",
    FinishReason.STOP_STRING: "stop",
    FinishReason.STOP_TOKEN: "stop",
    FinishReason.EOS: "stop",
    FinishReason.ABORT: "abort",
    FinishReason.ERROR: "error",
}

# -inf is not JSON; vLLM writes this instead.
MIN_LOGPROB = -9999.0


def finish_reason(reason: FinishReason | None) -> str | None:
    return None if reason is None else _FINISH_REASONS[reason]


def stop_reason(reason: FinishReason | None, matched_stop: str | int | None) -> str | int | None:
    """The stop string or stop token that ended the sample; None for EOS, as vLLM reports."""
    return None if reason is FinishReason.EOS else matched_stop


def usage(usages: list[Usage], with_details: bool) -> dict:
    prompt = sum(u.prompt_tokens for u in usages)
    completion = sum(u.completion_tokens for u in usages)
    body: dict = {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
    }
    if with_details:
        body["prompt_tokens_details"] = {"cached_tokens": sum(u.cached_tokens for u in usages)}
    return body


class TokenNames:
    """How a logprob's token is written: its text, or ``token_id:N``."""

    def __init__(self, as_ids: bool) -> None:
        self.as_ids = as_ids

    def __call__(self, token_id: int, token: str) -> str:
        return f"token_id:{token_id}" if self.as_ids else token


def _logprob(value: float) -> float:
    return max(value, MIN_LOGPROB)


class CompletionLogprobs:
    """The legacy completions ``logprobs`` object, accumulated over a sample's tokens."""

    def __init__(self, names: TokenNames, text_offset: int = 0) -> None:
        self.names = names
        self.offset = text_offset
        self.body: dict = {
            "text_offset": [],
            "token_logprobs": [],
            "tokens": [],
            "top_logprobs": [],
        }

    def add_unscored(self, token_id: int, token: str) -> None:
        """The first prompt token when echoing: nothing comes before it to score it."""
        self._append(self.names(token_id, token), None, None, len(token))

    def add(self, entries: list[TokenLogprob]) -> CompletionLogprobs:
        for entry in entries:
            top = {self.names(t.token_id, t.token): _logprob(t.logprob) for t in entry.top_logprobs}
            name = self.names(entry.token_id, entry.token)
            top.setdefault(name, _logprob(entry.logprob))
            self._append(name, _logprob(entry.logprob), top, len(entry.token))
        return self

    def _append(self, name: str, logprob: float | None, top: dict | None, length: int) -> None:
        self.body["text_offset"].append(self.offset)
        self.body["tokens"].append(name)
        self.body["token_logprobs"].append(logprob)
        self.body["top_logprobs"].append(top)
        self.offset += length


def _chat_token(names: TokenNames, token_id: int, token: str, logprob: float) -> dict:
    name = names(token_id, token)
    return {"token": name, "logprob": _logprob(logprob), "bytes": list(name.encode())}


def chat_logprobs(entries: list[TokenLogprob], names: TokenNames, num_top: int) -> dict:
    content = []
    for entry in entries:
        item = _chat_token(names, entry.token_id, entry.token, entry.logprob)
        item["top_logprobs"] = [
            _chat_token(names, t.token_id, t.token, t.logprob) for t in entry.top_logprobs[:num_top]
        ]
        content.append(item)
    return {"content": content}


def prompt_logprobs(entries: list[TokenLogprob], names: TokenNames) -> list[dict | None]:
    """vLLM's ``prompt_logprobs``: per prompt token (None for the first), token id -> its
    logprob, rank and text, for the token and the most likely alternatives."""

    def scored(token_id: int, token: str, logprob: float, rank: int | None) -> dict:
        return {"logprob": _logprob(logprob), "rank": rank, "decoded_token": names(token_id, token)}

    body: list[dict | None] = [None]
    for entry in entries:
        position = {
            str(t.token_id): scored(t.token_id, t.token, t.logprob, i + 1)
            for i, t in enumerate(entry.top_logprobs)
        }
        position[str(entry.token_id)] = scored(
            entry.token_id, entry.token, entry.logprob, entry.rank
        )
        body.append(position)
    return body
