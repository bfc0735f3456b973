"""``llmrpc serve --help`` and a bad flag answer from the flag table alone: until the flags are
parsed and checked, the command imports neither the REST gateway (FastAPI), gRPC, the generated
stubs, numpy, torch nor Transformers, which made both take 2-4 s on a busy machine."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

HEAVY = ("torch", "transformers", "fastapi", "grpc", "numpy", "llmrpc.v1", "llmrpc.gateway")

_SCRIPT = textwrap.dedent(
    """
    import sys
    from llmrpc.cli import main

    HEAVY = sys.argv.pop().split()

    try:
        main(sys.argv[1:])
    except SystemExit:
        pass
    print("imported:", sorted(m for m in HEAVY if m in sys.modules), file=sys.stderr)
    """
)


@pytest.mark.parametrize(
    "argv",
    [["serve", "--help"], ["serve", "--dtype", "bogus"], ["serve", "--max-num-seqs", "x"]],
    ids=" ".join,
)
def test_help_and_flag_errors_import_nothing_heavy(argv):
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT, *argv, " ".join(HEAVY)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "imported: []" in done.stderr, done.stderr[-2000:]
    assert done.stdout.startswith("usage: llmrpc serve") or "llmrpc serve: error:" in done.stderr
