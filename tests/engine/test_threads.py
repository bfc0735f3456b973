"""The engine's torch thread count: usable cores minus one (left to the frontend), or
OMP_NUM_THREADS."""

from __future__ import annotations

import threading

import pytest
import torch
from engine_utils import make_core

from llmrpc.engine.threads import engine_threads


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
