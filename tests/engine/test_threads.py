"""The engine's torch thread count: usable cores minus one (left to the frontend), or
OMP_NUM_THREADS; and, for an engine in its own process, every core while the rest of the machine
leaves one idle."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import torch
from engine_utils import make_core

from llmrpc.engine.request import SamplingParams
from llmrpc.engine.runner.threads import (
    ThreadBudget,
    engine_threads,
    idle_core_budget,
    machine_busy_seconds,
)


@pytest.mark.parametrize(
    ("environ", "cores", "expected"),
    [
        ({}, 1, 1),
        ({}, 2, 1),
        ({}, 16, 15),
        ({"OMP_NUM_THREADS": "2"}, 2, 2),
        ({"OMP_NUM_THREADS": " 3 "}, 64, 3),
        ({"OMP_NUM_THREADS": "4,2"}, 64, 4),  # nested levels: the outer one
        ({"OMP_NUM_THREADS": "0"}, 8, 1),
        ({"OMP_NUM_THREADS": ""}, 8, 7),
    ],
)
def test_rule(environ, cores, expected):
    assert engine_threads(environ, cores) == expected


def test_bad_omp_num_threads_is_named():
    with pytest.raises(ValueError, match="OMP_NUM_THREADS='many'"):
        engine_threads({"OMP_NUM_THREADS": "many"}, 4)


def test_engine_thread_runs_with_the_rule(tiny_llama_dir, monkeypatch):
    """An engine built on a thread of its own computes there with the rule's count, whatever
    the process's other threads use."""
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    seen = {}

    def build():
        core = make_core(tiny_llama_dir)
        seen["threads"] = torch.get_num_threads()
        seen["core"] = core

    worker = threading.Thread(target=build)
    worker.start()
    worker.join()
    assert seen["threads"] == 3


class FakeMachine:
    """The budget's neighbours: a clock, the machine's busy CPU seconds, this process's."""

    def __init__(self):
        self.now, self.busy, self.own = 100.0, 5000.0, 40.0

    def advance(self, seconds: float, others: float, own: float) -> None:
        """``seconds`` pass; the rest of the machine uses ``others`` cores, this process ``own``."""
        self.now += seconds
        self.busy += seconds * (others + own)
        self.own += seconds * own

    def budget(self, cores: int = 2) -> ThreadBudget:
        return ThreadBudget(
            cores, clock=lambda: self.now, machine=lambda: self.busy, own=lambda: self.own
        )

    def idle_budget(self) -> ThreadBudget:
        """A 2-core budget that has seen the rest of the machine idle: it gives 2 threads."""
        budget = self.budget()
        budget.threads_now()
        self.advance(0.3, others=0.0, own=1.0)
        assert budget.threads_now() == 2
        return budget


def test_budget_takes_every_core_while_the_rest_of_the_machine_leaves_one_idle():
    machine = FakeMachine()
    budget = machine.budget(cores=4)
    assert budget.threads_now() == 3  # nothing measured yet
    machine.advance(0.3, others=0.1, own=3.0)  # the engine busy, the rest nearly idle
    assert budget.threads_now() == 4
    assert budget.others == pytest.approx(0.1)
    machine.advance(0.3, others=0.9, own=3.0)  # another process keeps most of a core busy
    assert budget.threads_now() == 3
    assert budget.others == pytest.approx(0.9)
    machine.advance(0.3, others=0.49, own=1.0)
    assert budget.threads_now() == 4


def test_an_engine_takes_its_budgets_first_reading_at_start_up(monkeypatch):
    """The first step after an idle start judges the time since start-up: with the rest of the
    machine idle meanwhile, it already takes every core."""
    from types import SimpleNamespace

    from llmrpc.engine.core import engine_core

    machine = FakeMachine()
    monkeypatch.setattr(engine_core, "idle_core_budget", machine.budget)
    engine = SimpleNamespace(parallel=None, runner=SimpleNamespace(compiled_decode=None))
    assert engine_core.EngineCore.use_idle_cores(engine)
    machine.advance(5.0, others=0.1, own=0.0)  # idle until the first request
    assert engine.thread_budget.threads_now() == 2


def test_budget_checks_at_most_every_interval():
    machine = FakeMachine()
    budget = machine.idle_budget()
    machine.advance(0.1, others=1.0, own=1.0)  # within the interval: the last answer stands
    assert budget.threads_now() == 2
    machine.advance(0.2, others=1.0, own=1.0)  # measured over the 0.3 s since the last check
    assert budget.threads_now() == 1
    assert budget.others == pytest.approx(1.0)


def test_budget_without_the_machines_cpu_time_leaves_a_core():
    machine = FakeMachine()
    budget = machine.idle_budget()
    machine.advance(0.3, others=0.0, own=1.0)
    machine.busy = None  # /proc/stat unreadable
    assert budget.threads_now() == 1


def test_machine_busy_seconds_reads_proc_stat(tmp_path):
    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal guest guest_nice (in clock ticks)
    stat.write_text("cpu  1000 20 300 9000 50 7 3 70 0 0\ncpu0 1 2 3 4 5 6 7 8 9 10\n")
    ticks = os.sysconf("SC_CLK_TCK")
    assert machine_busy_seconds(str(stat)) == pytest.approx((1000 + 20 + 300 + 7 + 3 + 70) / ticks)
    assert machine_busy_seconds(str(tmp_path / "absent")) is None
    stat.write_text("garbage\n")
    assert machine_busy_seconds(str(stat)) is None


@pytest.mark.skipif(machine_busy_seconds() is None, reason="no /proc/stat")
def test_a_busy_process_beside_this_one_is_seen_as_the_rest_of_the_machine():
    """Real readings: a child process spinning for a second is at least half a core of the
    rest of the machine, this process's own CPU time apart."""
    budget = ThreadBudget(2, interval=0.0)
    budget.threads_now()
    spin = "import time\nend = time.time() + 1.2\nwhile time.time() < end: pass"
    spinner = subprocess.Popen([sys.executable, "-c", spin])
    try:
        time.sleep(1.0)
        assert budget.threads_now() == 1
        assert budget.others >= 0.5
    finally:
        spinner.wait()


def test_idle_core_budget_applies_only_where_the_count_is_not_fixed(monkeypatch):
    assert idle_core_budget({"OMP_NUM_THREADS": "2"}, cores=8) is None
    assert idle_core_budget({}, cores=1) is None
    budget = idle_core_budget({}, cores=8)
    assert budget is not None and (budget.cores, budget.threads) == (8, 7)


def test_engine_steps_with_the_count_its_budget_gives(tiny_llama_dir):
    machine = FakeMachine()
    core = make_core(tiny_llama_dir)
    core.thread_budget = machine.budget()
    threads = torch.get_num_threads()
    try:
        core.add_request("a", [5, 6, 7], SamplingParams(max_tokens=8, ignore_eos=True))
        core.step()
        assert torch.get_num_threads() == 1
        machine.advance(0.3, others=0.0, own=1.0)
        core.step()
        assert torch.get_num_threads() == 2
        machine.advance(0.3, others=1.0, own=1.0)
        core.step()
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
