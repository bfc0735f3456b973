"""Request-level types shared by the engine and its callers: parameters, outputs, finish reasons."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from llmrpc.engine.pooling.params import PoolingParams
from llmrpc.engine.timings import RequestTimings

if TYPE_CHECKING:
    import torch

    from llmrpc.engine.lora.types import LoRARef
    from llmrpc.engine.matching import SuffixTracker
    from llmrpc.engine.pooling.pooler import PoolerState
    from llmrpc.engine.structured_output.grammar import Grammar


class InvalidRequestError(ValueError):
    """A request the engine cannot serve as asked; ``field`` names the offending parameter."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class FinishReason(enum.Enum):
    LENGTH = "length"  # max_tokens reached, or the context window is full
    STOP_STRING = "stop_string"
    STOP_TOKEN = "stop_token"  # one of stop_token_ids
    EOS = "eos"
    ABORT = "abort"
    DEADLINE = "deadline"  # dropped while queued: the caller's deadline could not be met
    TIME_LIMIT = "time_limit"
    ERROR = "error"


_GREEDY_EPSILON = 1e-5

# Bounds on what one request may ask for (docs/api.md "Request limits"; the proto field comments say
# the same). Lists are bounded so that a request's set-up work on the engine thread stays within
# about one step; their per-step cost does not grow with their length (see engine/matching.py).
MAX_N = 128  # as OpenAI
MAX_STOP_STRINGS = 64  # OpenAI allows 4
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 1024
MAX_BAD_WORDS = 128  # each is tokenized twice when the request arrives
MAX_BAD_WORD_CHARS = 64
MAX_LOGIT_BIAS = 1024  # entries; OpenAI allows 300
MAX_ABS_LOGIT_BIAS = 100.0  # as OpenAI: a bias of -100 already bans a token in practice
_SEED_LIMIT = 2**64  # torch.Generator.manual_seed takes [0, 2^64)

_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "time_limit_s",
)


# JSON: the longest run of whitespace between two JSON tokens (--structured-output-max-whitespace):
# room for pretty-printing 3 levels deep with 4-space indents, none for a model running away in tabs
DEFAULT_MAX_JSON_WHITESPACE = 16


@dataclass(frozen=True)
class StructuredOutputSpec:
    """A constraint on the output's form (``engine/structured_output/grammar.py``)."""

    kind: str  # json_schema, json_object, regex, choice, grammar or structural_tag
    value: str = ""  # the schema's or structural tag's JSON text, the regex, the grammar
    choices: tuple[str, ...] = ()
    any_whitespace: bool = True  # JSON: optional whitespace allowed
    max_whitespace: int | None = DEFAULT_MAX_JSON_WHITESPACE  # JSON: per run (None: unbounded)
    additional_properties: bool = True  # JSON, guidance backend: unnamed properties allowed
    reasoning_end: tuple[int, ...] = ()  # applies once the output has these tokens in a row
    reasoning_start: int | None = None  # with reasoning_end: a first token that opens it
    backend: str = ""  # xgrammar or guidance, chosen by structured_output.check


@dataclass
class SamplingParams:
    """Sampling and stopping parameters of one request (vLLM's names and defaults)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1): disabled
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the context window
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    time_limit_s: float | None = None  # soft limit: ends with the output so far (TIME_LIMIT)
    repetition_penalty: float = 1.0  # > 1 discourages tokens of the prompt and the output
    presence_penalty: float = 0.0  # subtracted once from tokens already in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    logit_bias: dict[int, float] = field(default_factory=dict)
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = field(default_factory=list)
    n: int = 1  # parallel samples of the same prompt
    logprobs: int | None = None  # top-N logprobs per output token (0: the sampled token only)
    prompt_logprobs: int | None = None  # top-N logprobs per prompt token
    truncate_prompt_tokens: int | None = None  # keep only the last N prompt tokens
    priority: int = 0  # with --scheduling-policy priority: lower runs first
    # Who asked (API key digest, else the client's connection): callers take turns in the
    # waiting queue (engine/sched/request_queue.py); "" is one anonymous caller.
    caller: str = ""
    deadline: float | None = None  # time.monotonic() when the caller stops waiting
    structured_output: StructuredOutputSpec | None = None
    lora_name: str | None = None  # a loaded LoRA adapter (--enable-lora); None: the base model
    collect_timings: bool = False  # record RequestTimings for the finished output (tracing)
    pooling: PoolingParams | None = None  # set: an embedding request, prefill only, no sampling

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPSILON

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def validate(self) -> None:
        """Raise ``InvalidRequestError`` naming the first wrong field.

        Sizes are checked before items, so an oversized list costs O(1) to refuse. Token ids
        are checked against the vocabulary by the engine's ``InputProcessor``.
        """
        self._check_finite()
        self._check_lists()
        for name, ok, message in self._range_checks():
            if not ok:
                raise InvalidRequestError(name, message)

    def _check_finite(self) -> None:
        # NaN compares false with everything: without this, "nan >= 0" would be reported as
        # "must be >= 0", and inf would slip through every upper-bound-free check.
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):
                raise InvalidRequestError(name, "must be a finite number")

    def _check_lists(self) -> None:
        _check_size("stop", self.stop, MAX_STOP_STRINGS)
        _check_strings("stop", self.stop, MAX_STOP_STRING_CHARS)
        _check_size("bad_words", self.bad_words, MAX_BAD_WORDS)
        _check_strings("bad_words", self.bad_words, MAX_BAD_WORD_CHARS)
        _check_size("stop_token_ids", self.stop_token_ids, MAX_STOP_TOKEN_IDS)
        _check_size("logit_bias", self.logit_bias, MAX_LOGIT_BIAS)
        for bias in self.logit_bias.values():
            if not (math.isfinite(bias) and abs(bias) <= MAX_ABS_LOGIT_BIAS):
                raise InvalidRequestError(
                    "logit_bias",
                    f"biases must be finite numbers in [-{MAX_ABS_LOGIT_BIAS:g}, "
                    f"{MAX_ABS_LOGIT_BIAS:g}]",
                )
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise InvalidRequestError("allowed_token_ids", "must not be empty")

    def _range_checks(self):
        yield "temperature", self.temperature >= 0, "must be >= 0"
        yield "top_p", 0 < self.top_p <= 1, "must be in (0, 1]"
        yield "top_k", self.top_k >= -1, "must be -1, 0 (disabled) or positive"
        yield "min_p", 0 <= self.min_p <= 1, "must be in [0, 1]"
        yield "seed", self.seed is None or 0 <= self.seed < _SEED_LIMIT, "must be in [0, 2^64)"
        yield "max_tokens", self.max_tokens is None or self.max_tokens >= 1, "must be >= 1"
        yield "min_tokens", self.min_tokens >= 0, "must be >= 0"
        yield (
            "min_tokens",
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "must not exceed max_tokens",
        )
        yield "time_limit_s", self.time_limit_s is None or self.time_limit_s > 0, "must be > 0"
        yield "repetition_penalty", self.repetition_penalty > 0, "must be > 0"
        yield "presence_penalty", -2 <= self.presence_penalty <= 2, "must be in [-2, 2]"
        yield "frequency_penalty", -2 <= self.frequency_penalty <= 2, "must be in [-2, 2]"
        yield "n", 1 <= self.n <= MAX_N, f"must be in [1, {MAX_N}]"
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            yield name, value is None or value >= 0, "must be >= 0"
        yield (
            "truncate_prompt_tokens",
            self.truncate_prompt_tokens is None or self.truncate_prompt_tokens >= 1,
            "must be >= 1",
        )


def _check_size(name: str, items, bound: int) -> None:
    if len(items) > bound:
        raise InvalidRequestError(name, f"at most {bound} entries, got {len(items)}")


def _check_strings(name: str, strings: list[str], max_chars: int) -> None:
    for index, string in enumerate(strings):
        if not string:
            raise InvalidRequestError(f"{name}[{index}]", "must not be empty")
        if len(string) > max_chars:
            raise InvalidRequestError(
                f"{name}[{index}]", f"at most {max_chars} characters, got {len(string)}"
            )


@dataclass
class TokenLogprobs:
    """The logprob and rank of one chosen token, and the top alternatives at its position."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top: list[tuple[int, float]] = field(default_factory=list)  # (token_id, logprob), best first


@dataclass
class RequestOutput:
    """One increment of a request's output, as the engine hands it to its caller.

    ``text`` and ``token_ids`` are deltas since the previous output of the same request.
    """

    request_id: str
    text: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the matched stop string or stop token id
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # total so far
    num_cached_tokens: int = 0
    error: str | None = None
    error_field: str | None = None  # with error: the request's field at fault (its own input)
    index: int = 0  # which of the request's n samples this is
    logprobs: list[TokenLogprobs] | None = None  # one per token of token_ids, when asked
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # first output only; None first
    timings: RequestTimings | None = None  # the last output of a request timed for tracing
    embedding: list[float] | None = None  # a pooling request's result (engine/pooling/pooler.py)

    def merge(self, later: RequestOutput) -> None:
        """Fold a later delta of the same sample into this one (for a consumer that lags)."""
        self.text += later.text
        self.token_ids.extend(later.token_ids)
        if later.logprobs is not None:
            self.logprobs = (self.logprobs or []) + later.logprobs
        for name in (
            "finished",
            "finish_reason",
            "stop_reason",
            "num_output_tokens",
            "num_cached_tokens",
            "error",
            "error_field",
            "timings",
            "embedding",
        ):
            setattr(self, name, getattr(later, name))


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class Request:
    """Engine-side state of one request: its tokens, progress and KV block hashes."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        eos_token_ids: frozenset[int] = frozenset(),
        arrival_time: float = 0.0,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.arrival_time = arrival_time
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        # Draft tokens this step verifies after the last token (speculative decoding; never in
        # all_token_ids: those the target accepts are appended as it samples them)
        self.spec_token_ids: list[int] = []
        self.num_cached_tokens = -1  # prefix-cache hit of the first scheduling; -1 until then
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.block_hashes: list = []  # chained hashes of the full blocks of all_token_ids
        # a longrope model's request past original_max_position_embeddings: every row takes the
        # long factors (its KV differs from a shorter request's; the scheduler sets it)
        self.rope_long = False
        # Set by the engine from params.bad_words: where the output stands in their automaton.
        self.bad_words: SuffixTracker | None = None
        # Built once from params by the logits processors (allowed-token mask, logit bias
        # tensors...), so a step does not pay for the lists again; the n samples share it.
        self.params_cache: dict[str, object] = {}
        self.output_counts: dict[int, int] = {}  # occurrences of each output token (penalties)
        self.prompt_logprobs: list[TokenLogprobs | None] = []  # filled while the prompt is computed
        self.finish_reason: FinishReason | None = None
        self.stop_reason: str | int | None = None
        # Set by the engine from params.structured_output (engine/structured_output/grammar.py), and
        # per step, for a request that samples under it, the tokens its grammar allows.
        self.grammar: Grammar | None = None
        self.grammar_mask: torch.Tensor | None = None  # [vocab_size] bool
        self.lora: LoRARef | None = None  # the adapter params.lora_name names, as resolved
        self.timings: RequestTimings | None = None  # set when params.collect_timings
        # A pooling request's pooler and what it has gathered (engine/pooling/pooler.py)
        self.pooler_state: PoolerState | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        self.output_counts[token_id] = self.output_counts.get(token_id, 0) + 1
