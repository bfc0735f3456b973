"""Grammar compiles: a small pool where a cheap or cached grammar never waits behind an
expensive one, and a time bound past which a request's grammar fails and the rest go on.

An "expensive" grammar here is one whose build waits on an event (a real one would burn a core
for many seconds): what is asserted is the order things finish in, never how fast.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time

import pytest
from engine_utils import make_core

from llmrpc.engine.request import FinishReason, SamplingParams, StructuredOutputSpec
from llmrpc.engine.structured_output import lanes as grammar_lanes
from llmrpc.engine.structured_output.compiler import GrammarCompiler

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
WAIT_S = 30  # only ever reached when the behaviour under test is broken


@pytest.fixture(scope="module")
def core(tiny_llama_dir):
    return make_core(tiny_llama_dir)


def _expensive(index: int) -> StructuredOutputSpec:
    """A choice list of about 200 KB: the kind that took 19 s to compile."""
    return StructuredOutputSpec("choice", choices=tuple(f"{index}-{j:0200d}" for j in range(1000)))


class _Blocked:
    """Makes the builds of the specs ``blocks`` picks wait until ``release`` is set; then they
    build, or with ``stand_in`` build a trivial regex instead (no real expensive compile)."""

    def __init__(self, compiler, blocks, monkeypatch, stand_in: bool = False) -> None:
        self.release = threading.Event()
        self.started = []
        real_build = compiler._build

        def build(spec):
            if not blocks(spec):
                return real_build(spec)
            self.started.append(spec)
            self.release.wait(WAIT_S)
            if stand_in:
                spec = StructuredOutputSpec("regex", "x", backend=spec.backend)
            return real_build(spec)

        monkeypatch.setattr(compiler, "_build", build)


def test_cheap_and_cached_grammars_do_not_wait_behind_expensive_ones(core, monkeypatch):
    compiler = GrammarCompiler(core.tokenizer, core.hf_config.vocab_size, core.eos_token_ids)
    cached = StructuredOutputSpec("regex", "[ab]{3}")
    compiler.submit(cached, "xgrammar").result(WAIT_S)
    blocked = _Blocked(compiler, lambda spec: spec.kind == "choice", monkeypatch, stand_in=True)
    try:
        expensive = [compiler.submit(_expensive(i), "xgrammar") for i in range(4)]
        again = compiler.submit(cached, "xgrammar")
        assert again.done(), "a cached grammar was queued"
        cheap = [
            compiler.submit(StructuredOutputSpec("json_object"), "auto"),
            compiler.submit(StructuredOutputSpec("json_schema", json.dumps(SCHEMA)), "guidance"),
            compiler.submit(StructuredOutputSpec("regex", "[0-9]{4}"), "xgrammar"),
        ]
        for future in cheap:
            future.result(WAIT_S)
        assert blocked.started, "no expensive compile had started"
        assert not any(future.done() for future in expensive)
    finally:
        blocked.release.set()
    for future in expensive:
        future.result(WAIT_S)


def _wait_for(condition) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


def test_a_short_grammar_that_proves_slow_holds_up_no_cheap_one(core, monkeypatch):
    # 40 characters, and 2.8 s of compiling each with xgrammar: its text does not tell its cost
    monkeypatch.setattr(grammar_lanes, "SLOW_S", 0.05)
    compiler = GrammarCompiler(core.tokenizer, core.hf_config.vocab_size, core.eos_token_ids)
    compiler.warmed.result(WAIT_S)
    blocked = _Blocked(compiler, lambda spec: "maxLength" in spec.value, monkeypatch, True)
    try:
        slow = [
            compiler.submit(StructuredOutputSpec("json_schema", json.dumps(schema)), "xgrammar")
            for schema in ({"type": "string", "maxLength": 3000 + i} for i in range(3))
        ]
        _wait_for(lambda: len(blocked.started) == 3)  # the third once the first two prove slow
        cheap = compiler.submit(StructuredOutputSpec("json_object"), "xgrammar")
        cheap.result(WAIT_S)
        assert not any(future.done() for future in slow)
    finally:
        blocked.release.set()
    for future in slow:
        future.result(WAIT_S)


def test_the_same_grammar_compiling_twice_at_once_is_compiled_once(core, monkeypatch):
    compiler = GrammarCompiler(core.tokenizer, core.hf_config.vocab_size, core.eos_token_ids)
    compiler.warmed.result(WAIT_S)
    blocked = _Blocked(compiler, lambda spec: spec.kind == "regex", monkeypatch)
    spec = StructuredOutputSpec("regex", "[cd]{2}")
    try:
        first, second = compiler.submit(spec, "xgrammar"), compiler.submit(spec, "xgrammar")
        _wait_for(lambda: blocked.started)
    finally:
        blocked.release.set()
    assert first.result(WAIT_S) == second.result(WAIT_S)
    assert len(blocked.started) == 1


def _run_until_done(core) -> dict:
    outputs = {}
    deadline = time.monotonic() + WAIT_S
    while core.has_unfinished_requests:
        assert time.monotonic() < deadline, f"still unfinished: {list(core.scheduler.requests)}"
        for output in core.step():
            if output.request_id in outputs:
                outputs[output.request_id].merge(output)
            else:
                outputs[output.request_id] = output
    return outputs


def test_a_grammar_past_the_time_bound_fails_and_the_engine_goes_on(core, monkeypatch):
    compiler = core.grammar_compiler
    monkeypatch.setattr(compiler, "timeout_s", 0.5, raising=False)
    slow = StructuredOutputSpec("regex", "(slow){2}")
    blocked = _Blocked(compiler, lambda spec: spec.value == slow.value, monkeypatch)
    fast = StructuredOutputSpec("regex", "[ab]{3}")
    try:
        core.add_request(
            "slow", [1, 2], SamplingParams(seed=0, max_tokens=9, structured_output=slow)
        )
        core.add_request(
            "fast", [1, 2], SamplingParams(seed=1, max_tokens=9, structured_output=fast)
        )
        core.add_request("free", [1, 2], SamplingParams(seed=2, max_tokens=5))
        outputs = _run_until_done(core)
    finally:
        blocked.release.set()
    failed = outputs["slow"]
    assert failed.finish_reason is FinishReason.ERROR
    assert failed.error_field == "structured_output.regex"  # INVALID_ARGUMENT, HTTP 400
    assert "--structured-output-compile-timeout" in failed.error, failed.error
    assert re.fullmatch("[ab]{3}", outputs["fast"].text)
    assert outputs["free"].finish_reason is FinishReason.LENGTH
    # the engine carries on: the grammar that was late compiles for the next request
    core.add_request("later", [1, 2], SamplingParams(seed=3, max_tokens=9, structured_output=slow))
    assert _run_until_done(core)["later"].text == "slowslow"
    assert core.kv_manager.num_free_blocks == core.kv_manager.num_blocks


_EXIT_DURING_A_COMPILE = """
import threading
import torch
from llmrpc.engine.structured_output.lanes import CompileLane
a = torch.randn(3000, 3000)
started = threading.Event()
def compile():  # native code with the GIL released, as xgrammar's and llguidance's compiles run
    started.set()
    return a @ a @ a @ a
CompileLane("grammar", 1, 2).submit(compile)
started.wait()
"""


def test_a_process_that_exits_during_a_compile_exits_cleanly():
    """A lane thread still running when its process exits is ended where it next takes the
    GIL. Coming back from a compile, or freeing the tensor this one returns, that is inside C++
    frames that cannot unwind, and the process aborted ("terminate called without an active
    exception", status 134). Every new compiler reads the vocabulary on a lane thread (about
    0.2 s for SmolLM2's); the device check's dry run, whose tests end seconds after making their
    engines, once aborted at exit with that message. Now the lanes' threads end, their compiles
    done, before the interpreter goes."""
    done = subprocess.run(
        [sys.executable, "-c", _EXIT_DURING_A_COMPILE], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
