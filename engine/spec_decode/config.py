"""``--speculative-config``: vLLM's JSON object (or its dotted keys), checked whole.

Methods: ``ngram`` (prompt lookup over the request's own tokens) and ``draft_model`` (a smaller
model with the target's tokenizer proposes). Every other method vLLM names stops start-up,
naming it; a key the chosen method does not use stops it too, so nothing given is silently
ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# vLLM's default n-gram lengths when neither prompt_lookup_min nor _max is given
DEFAULT_PROMPT_LOOKUP = 5
MAX_SPECULATIVE_TOKENS = 16  # one verify step's rows per request: more is never worth it here
_COMMON_KEYS = frozenset(
    {"method", "model", "num_speculative_tokens", "disable_by_batch_size", "max_model_len"}
)
_KEYS = {
    "ngram": _COMMON_KEYS | {"prompt_lookup_min", "prompt_lookup_max"},
    "draft_model": _COMMON_KEYS | {"draft_tensor_parallel_size"},
}
# Methods vLLM has that this build does not: what each needs, for the refusal
_OTHER_METHODS = {
    "eagle": "EAGLE draft heads",
    "eagle3": "EAGLE-3 draft heads",
    "medusa": "Medusa heads",
    "mlp_speculator": "MLP speculator heads",
    "mtp": "the model's multi-token-prediction layers",
    "deepseek_mtp": "the model's multi-token-prediction layers",
    "suffix": "a suffix tree over past requests",
}
_NGRAM_NAMES = ("ngram", "[ngram]")
_METHODS = "ngram and draft_model"


def _flag(message: str) -> ValueError:
    return ValueError(f"--speculative-config: {message}")


def _positive_int(config: dict, key: str, minimum: int = 1) -> int | None:
    value = config.get(key)
    if value is None:
        return None
    if type(value) is not int or value < minimum:
        raise _flag(f"{key} must be an integer >= {minimum}, got {value!r}")
    return value


@dataclass(frozen=True)
class SpeculativeConfig:
    """The checked configuration; ``config`` None (the default): no speculation."""

    config: dict | None = None
    method: str = field(init=False, default="")
    num_speculative_tokens: int = field(init=False, default=0)
    prompt_lookup_min: int = field(init=False, default=0)
    prompt_lookup_max: int = field(init=False, default=0)
    model: str | None = field(init=False, default=None)  # draft_model: the draft's name or path
    # no proposals in a step whose batch has at least this many requests (None: always)
    disable_by_batch_size: int | None = field(init=False, default=None)
    # no proposals for a request once its tokens and the proposal would pass this (None: none)
    max_model_len: int | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        config = self.config
        if config is None:
            return
        if not config:
            raise _flag("an empty object; give at least method and num_speculative_tokens")
        method = _method_of(config)
        if method not in _KEYS:
            needs = _OTHER_METHODS.get(method)
            if needs is None:
                raise _flag(f"unknown method {method!r}; this build speculates with {_METHODS}")
            raise _flag(
                f"method {method!r} needs {needs}, which this build does not have; it "
                f"speculates with {_METHODS}"
            )
        keys = _KEYS[method]
        unknown = sorted(set(config) - keys)
        if unknown:
            raise _flag(
                f"{', '.join(map(repr, unknown))} {'is' if len(unknown) == 1 else 'are'} not "
                f"used by method {method}; it takes {', '.join(sorted(keys))}"
            )
        set_ = object.__setattr__
        set_(self, "method", method)
        model = config.get("model")
        if method == "ngram":
            if model is not None and model not in _NGRAM_NAMES:
                raise _flag(f'method ngram takes no model (or model "ngram"), got {model!r}')
            self._lookup_lengths(config)
        else:
            if not isinstance(model, str) or not model or model in _NGRAM_NAMES:
                raise _flag(
                    f"method draft_model needs model: the draft's name or path, got {model!r}"
                )
            set_(self, "model", model)
            draft_tp = _positive_int(config, "draft_tensor_parallel_size")
            if draft_tp not in (None, 1):
                raise _flag(
                    f"draft_tensor_parallel_size {draft_tp}: the draft runs in the target's "
                    "process, on one device (1)"
                )
        num = _positive_int(config, "num_speculative_tokens")
        if num is None:
            raise _flag("num_speculative_tokens is required")
        if num > MAX_SPECULATIVE_TOKENS:
            raise _flag(f"num_speculative_tokens must be at most {MAX_SPECULATIVE_TOKENS}")
        set_(self, "num_speculative_tokens", num)
        set_(self, "disable_by_batch_size", _positive_int(config, "disable_by_batch_size"))
        set_(self, "max_model_len", _positive_int(config, "max_model_len"))

    def _lookup_lengths(self, config: dict) -> None:
        low = _positive_int(config, "prompt_lookup_min")
        high = _positive_int(config, "prompt_lookup_max")
        if low is None and high is None:
            low = high = DEFAULT_PROMPT_LOOKUP
        low, high = low or high, high or low
        if low > high:
            raise _flag(f"prompt_lookup_min ({low}) must not exceed prompt_lookup_max ({high})")
        object.__setattr__(self, "prompt_lookup_min", low)
        object.__setattr__(self, "prompt_lookup_max", high)

    @property
    def enabled(self) -> bool:
        return self.config is not None


def _method_of(config: dict) -> str:
    """The method, as vLLM infers it: ``method``, else from ``model`` ("ngram", or a draft)."""
    method = config.get("method")
    model = config.get("model")
    if method is None:
        if model is None:
            raise _flag("give a method (ngram or draft_model), or a model")
        if model in _NGRAM_NAMES:
            return "ngram"
        return "draft_model"
    if not isinstance(method, str):
        raise _flag(f"method must be a string, got {method!r}")
    return "ngram" if method in _NGRAM_NAMES else method


def check_speculative_options(
    speculative: SpeculativeConfig, tensor_parallel_size: int, runner: str, batch_invariant: bool
) -> None:
    """Features this build does not combine with speculation, refused in one line each."""
    if not speculative.enabled:
        return
    refusals = (
        (tensor_parallel_size > 1, f"--tensor-parallel-size {tensor_parallel_size}"),
        (runner == "pooling", "--runner pooling (embeddings sample no tokens)"),
        (batch_invariant, "--batch-invariant"),
    )
    for refused, what in refusals:
        if refused:
            raise ValueError(f"--speculative-config is refused with {what} in this build")
