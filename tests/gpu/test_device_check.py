"""The GPU machine's check, kept from rotting: ``DRY_RUN=1 tests/gpu/device_check.sh`` on the CPU,
in ``.venv-device`` (made by ``make device-venv``: only the packages the device image has that we
use, plus the carried wheels), so that an import of a package the image lacks, a fixture that needs
the packaged model, or a lost exit code fails here. ``make test`` sets
``LLMRPC_REQUIRE_DEVICE_DRY_RUN=1``: there a missing ``.venv-device`` is a failure, not a skip."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEVICE_PYTHON = ROOT / ".venv-device" / "bin" / "python"
STAGES = ("versions", "kernels", "engine", "graphs", "staging", "bandwidth", "throughput")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def device_python() -> Path:
    if not DEVICE_PYTHON.is_file():
        if os.environ.get("LLMRPC_REQUIRE_DEVICE_DRY_RUN") == "1":
            pytest.fail(f"{DEVICE_PYTHON} is missing: make device-venv builds it")
        pytest.skip("no .venv-device: make device-venv builds it")
    return DEVICE_PYTHON


def _check(tmp_path: Path, python: Path, **env: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "out"
    done = subprocess.run(
        ["bash", str(ROOT / "tests/gpu/device_check.sh")],
        env={
            "PATH": os.environ["PATH"],
            "HOME": os.environ.get("HOME", str(tmp_path)),
            "TMPDIR": str(tmp_path),
            "DRY_RUN": "1",
            "PYTHON": str(python),
            "WHEELS": str(python.parents[1] / "wheels"),
            "OUT": str(out),
            **env,
        },
        capture_output=True,
        text=True,
        timeout=540,
    )
    rows = {}
    for line in (out / "summary.txt").read_text().splitlines():
        name, rc, *_ = line.split()
        rows[name] = rc.removeprefix("rc=")
    return done, rows


def test_dry_run_passes_every_stage_in_the_device_image_packages(tmp_path, device_python):
    done, rows = _check(tmp_path, device_python)
    tail = (done.stdout + done.stderr)[-4000:]
    assert done.returncode == 0, tail
    assert rows == dict.fromkeys(STAGES, "0"), tail
    out = tmp_path / "out"
    for name in ("junit.xml", "results.json", "log.txt"):
        assert (out / name).stat().st_size > 0, name
    assert "testcase" in (out / "junit.xml").read_text()


def test_a_failed_stage_fails_the_check_and_the_rest_still_run(tmp_path, device_python):
    done, rows = _check(tmp_path, device_python, STAGES="versions,bandwidth", FAIL_STAGE="versions")
    assert done.returncode == 1, (done.stdout + done.stderr)[-4000:]
    assert rows == {"versions": "97", "bandwidth": "0"}


def test_the_stage_limits_leave_the_check_within_nine_minutes():
    """A lent GPU machine gives minutes, start-up included: the stages' own time limits add up
    to at most 510 s, leaving the set-up (wheels, the stand-in model) half a minute."""
    script = (ROOT / "tests/gpu/device_check.sh").read_text()
    limits = dict(re.findall(r"^(?:pytest_)?stage (\w+) (\d+) ", script, flags=re.MULTILINE))
    assert set(limits) == set(STAGES)
    assert sum(map(int, limits.values())) <= 510, limits
