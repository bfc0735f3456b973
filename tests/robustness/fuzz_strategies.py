"""Hypothesis strategies for GenerateRequest fields, for tests/robustness/test_fuzz_grpc.py.

``request_fields`` draws, in equal shares: sane requests (valid ranges, short prompts: they
mostly run, so their answers can be checked); requests with one wild field (so that each field's
own check is reached, not only the first one that fails); and chaos, where any field may be
wild. A wild field may be NaN, infinite, negative, huge, an odd Unicode string, a list at or
just past its bound (engine/request.py), an empty oneof, an unknown model or a broken template.
"""

from __future__ import annotations

import math

from google.protobuf import struct_pb2
from hypothesis import strategies as st

from llmrpc.v1 import common_pb2, generation_pb2

VOCAB = 49152  # the tiny test model's (SmolLM2's tokenizer)
UINT32_MAX = 2**32 - 1
INT32 = st.integers(-(2**31), 2**31 - 1)
MAX_WAITING = 8  # the fuzz server's --max-waiting-requests
CHAOS_ODDS = 6  # in chaos, each field is wild one time in CHAOS_ODDS

odd_text = st.text(st.characters(exclude_categories=("Cs",)), max_size=40)  # UTF-8 encodable
# NaN, +-inf, huge, tiny and negative values, the special ones often.
SPECIAL_FLOATS = [math.nan, math.inf, -math.inf, 3e38, -3e38, 1e-45, -1.0]
floats32 = st.one_of(st.sampled_from(SPECIAL_FLOATS), st.floats(width=32))
any_token_id = st.integers(0, UINT32_MAX)
small_token_id = st.integers(0, 500)
# Short strings of common letters, so that stop strings and bad words do occur in outputs.
common_text = st.text("aeinost ", min_size=1, max_size=3)


def repeated(item, sizes: list[int]):
    """Lists of one drawn item repeated to a size at or just past a bound (cheap to build)."""
    return st.builds(lambda value, size: [value] * size, item, st.sampled_from(sizes))


def bias_table(sizes: list[int], bias):
    return st.builds(
        lambda size, value: dict.fromkeys(range(size), value), st.sampled_from(sizes), bias
    )


class Wild:
    """Which fields of a request are wild: those named, or (``None``) any of them by chance."""

    def __init__(self, names: frozenset[str] | None) -> None:
        self.names = names

    @property
    def chaos(self) -> bool:
        return self.names is None

    def choose(self, name: str, sane, insane):
        if self.chaos:
            return st.integers(0, CHAOS_ODDS - 1).flatmap(lambda k: insane if k == 0 else sane)
        return insane if name in self.names else sane

    def section(self, fields: dict[str, tuple], plain: dict, required=()):
        """A message's fields: ``fields`` maps a name to its (sane, insane) strategies; the
        ``required`` ones and a targeted wild one are always set, the others may be unset."""
        always, optional = {}, dict(plain)
        for name, (sane, insane) in fields.items():
            chosen = self.choose(name, sane, insane)
            targeted = not self.chaos and name in self.names
            (always if targeted or name in required else optional)[name] = chosen
        return st.fixed_dictionaries(always, optional=optional)


SANE = Wild(frozenset())
CHAOS = Wild(None)


def sampling(wild: Wild):
    bias = st.floats(-100, 100, width=32)
    temperature = st.one_of(st.floats(0, 2), st.sampled_from([0.0, 1e30, 3e38]))
    fields = {
        "temperature": (temperature, floats32),
        "top_p": (st.floats(0.05, 1), floats32),
        "top_k": (st.integers(-1, 50), INT32),
        "min_p": (st.floats(0, 1), floats32),
        "repetition_penalty": (
            st.one_of(st.floats(0.5, 2), st.sampled_from([1e-38, 3e38])),
            floats32,
        ),
        "presence_penalty": (st.floats(-2, 2), floats32),
        "frequency_penalty": (st.floats(-2, 2), floats32),
        "logit_bias": (
            st.one_of(st.dictionaries(small_token_id, bias, max_size=4), bias_table([1024], bias)),
            st.one_of(
                st.dictionaries(any_token_id, floats32, min_size=1, max_size=3),
                bias_table([1025], bias),
            ),
        ),
        "allowed_token_ids": (
            st.one_of(st.lists(small_token_id, max_size=5), st.just(list(range(VOCAB)))),
            st.one_of(st.lists(any_token_id, max_size=3), st.just(list(range(VOCAB)) + [0])),
        ),
        "bad_words": (
            st.one_of(st.lists(common_text, max_size=4), repeated(common_text, [128])),
            st.one_of(st.lists(odd_text, min_size=1, max_size=3), repeated(odd_text, [129])),
        ),
        "n": (
            st.sampled_from([1, 1, 2, 3]),
            st.sampled_from([0, MAX_WAITING, MAX_WAITING + 1, 128, 129, UINT32_MAX]),
        ),
    }
    return wild.section(fields, {"seed": st.integers(0, UINT32_MAX)})


def stopping(wild: Wild):
    fields = {
        # Short outputs keep the run short; only in chaos may max_tokens be unset (16).
        "max_tokens": (st.integers(1, 4), st.sampled_from([0, 127, 128, UINT32_MAX])),
        "min_tokens": (st.integers(0, 1), st.sampled_from([13, UINT32_MAX])),
        "stop": (
            st.one_of(st.lists(common_text, max_size=4), repeated(common_text, [64])),
            st.one_of(st.lists(odd_text, min_size=1, max_size=3), repeated(odd_text, [65])),
        ),
        "stop_token_ids": (
            st.one_of(st.lists(small_token_id, max_size=4), repeated(small_token_id, [1024])),
            st.one_of(
                st.lists(any_token_id, min_size=1, max_size=3), repeated(small_token_id, [1025])
            ),
        ),
        "time_limit_ms": (st.sampled_from([50, 10_000]), st.sampled_from([0, 1])),
    }
    plain = {
        "ignore_eos": st.booleans(),
        "include_stop_str_in_output": st.booleans(),
    }
    return wild.section(fields, plain, required=() if wild.chaos else ("max_tokens",))


def output(wild: Wild):
    fields = {
        "logprobs": (st.integers(0, 5), st.integers(21, UINT32_MAX)),
        "prompt_logprobs": (st.integers(0, 5), st.integers(21, UINT32_MAX)),
    }
    plain = {
        "skip_special_tokens": st.booleans(),
        "spaces_between_special_tokens": st.booleans(),
    }
    return wild.section(fields, plain)


BROKEN_TEMPLATES = [
    "{% for m in messages %}",  # a syntax error
    "{{ raise_exception('no') }}",
    "{{ messages[99].content }}",
    "{{ messages | length // 0 }}",
]


def chat(broken: bool):
    role = st.sampled_from(["system", "user", "assistant"])
    return st.builds(
        common_pb2.Chat,
        messages=st.lists(
            st.builds(
                common_pb2.ChatMessage,
                role=st.one_of(role, odd_text) if broken else role,
                content=odd_text,
            ),
            min_size=0 if broken else 1,
            max_size=3,
        ),
        add_generation_prompt=st.one_of(st.none(), st.booleans()),
        continue_final_message=st.one_of(st.none(), st.booleans()) if broken else st.none(),
        chat_template=st.one_of(st.none(), st.sampled_from(BROKEN_TEMPLATES))
        if broken
        else st.none(),
        chat_template_kwargs=st.builds(
            lambda d: struct_pb2.Struct(
                fields={k: struct_pb2.Value(string_value=v) for k, v in d.items()}
            ),
            st.dictionaries(odd_text, odd_text, max_size=2),
        ),
    )


def prompt(wild: Wild):
    def text(max_size: int):
        return st.text(st.characters(exclude_categories=("Cs",)), max_size=max_size)

    def token_ids(ids, min_size: int, max_size: int):
        ids = st.lists(ids, min_size=min_size, max_size=max_size)
        return st.builds(lambda i: {"token_ids": common_pb2.TokenIds(ids=i)}, ids)

    sane = st.one_of(
        st.builds(lambda t: {"text": t}, text(60)),
        token_ids(st.integers(0, VOCAB - 1), 1, 40),
        st.builds(lambda c: {"chat": c}, chat(broken=False)),
    )
    insane = st.one_of(
        st.just({}),  # no input at all
        st.builds(lambda t: {"text": t}, text(300)),  # may be longer than the context
        token_ids(st.one_of(st.integers(0, VOCAB - 1), any_token_id), 0, 140),
        st.builds(lambda c: {"chat": c}, chat(broken=True)),
    )
    return wild.choose("input", sane, insane)


def request(wild: Wild):
    fields = {
        "request_id": (st.text("abc-_1", max_size=20), odd_text),
        "model": (st.just(""), odd_text),
        "truncate_prompt_tokens": (st.integers(1, 50), st.sampled_from([0, UINT32_MAX])),
    }
    plain = {"add_special_tokens": st.booleans(), "priority": INT32}
    messages = st.fixed_dictionaries(
        {
            "prompt": prompt(wild),
            "sampling": sampling(wild),
            "stopping": stopping(wild),
            "output": output(wild),
        }
    )
    return st.tuples(messages, wild.section(fields, plain)).map(lambda t: {**t[0], **t[1]})


WILD_FIELDS = [
    *("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty"),
    *("frequency_penalty", "logit_bias", "allowed_token_ids", "bad_words", "n", "max_tokens"),
    *("min_tokens", "stop", "stop_token_ids", "time_limit_ms", "logprobs", "prompt_logprobs"),
    *("input", "request_id", "model", "truncate_prompt_tokens"),
]

request_fields = st.one_of(
    request(SANE),
    st.sampled_from(WILD_FIELDS).flatmap(lambda name: request(Wild(frozenset({name})))),
    request(CHAOS),
)


def build_request(fields: dict) -> generation_pb2.GenerateRequest:
    fields = dict(fields)
    return generation_pb2.GenerateRequest(
        **fields.pop("prompt"),
        sampling=common_pb2.SamplingParams(**fields.pop("sampling")),
        stopping=common_pb2.StoppingCriteria(**fields.pop("stopping")),
        output=common_pb2.OutputOptions(**fields.pop("output")),
        **fields,
    )
