"""A GGUF conversion leaves no ``.tmp-*`` folder in the cache when it is interrupted: it removes
its folder on any exit, ``llmrpc serve`` stopped mid-conversion included, and the next
conversion sweeps away what a killed one left, never another live conversion's folder."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llmrpc.engine.loading import loader


def _fake_gguf(path: Path) -> Path:
    path.write_bytes(b"GGUF" + os.urandom(16))
    return path


def _leftovers(cache: Path) -> list[str]:
    converted = cache / "converted"
    return sorted(p.name for p in converted.glob(".tmp-*")) if converted.exists() else []


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_failed_conversion_removes_its_folder(tmp_path, monkeypatch):
    def broken(gguf_path: Path, out_dir: Path) -> None:
        (out_dir / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("out of disk")

    monkeypatch.setattr(loader, "convert_gguf", broken)
    with pytest.raises(RuntimeError):
        loader.resolve_model_dir(str(_fake_gguf(tmp_path / "m.gguf")), cache_dir=tmp_path)
    assert _leftovers(tmp_path) == []


def test_the_next_conversion_sweeps_folders_of_dead_conversions_only(tmp_path, monkeypatch):
    def fake_convert(gguf_path: Path, out_dir: Path) -> None:
        (out_dir / "config.json").write_text("{}")

    monkeypatch.setattr(loader, "convert_gguf", fake_convert)
    converted = tmp_path / "converted"
    converted.mkdir()
    host = socket.gethostname()
    dead = converted / f".tmp-x.Q4-abc-{_dead_pid()}@{host}-k1lled00"
    live = converted / f".tmp-x.Q4-abc-{os.getpid()}@{host}-running0"
    elsewhere = converted / f".tmp-x.Q4-abc-{_dead_pid()}@another-machine-running1"
    stale_unnamed = converted / ".tmp-x.Q4-abc-oldstyle"  # no pid: known dead only by its age
    fresh_unnamed = converted / ".tmp-x.Q4-abc-oldstyl2"
    for folder in (dead, live, elsewhere, stale_unnamed, fresh_unnamed):
        folder.mkdir()
    two_days_ago = time.time() - 2 * 86400
    os.utime(stale_unnamed, (two_days_ago, two_days_ago))

    loader.resolve_model_dir(str(_fake_gguf(tmp_path / "m.gguf")), cache_dir=tmp_path)

    assert _leftovers(tmp_path) == sorted(p.name for p in (live, elsewhere, fresh_unnamed))


def test_serve_stopped_while_converting_leaves_no_folder(tmp_path):
    gguf = loader.packaged_gguf_path()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", loader.CACHE_ENV: str(tmp_path)}
    command = [
        sys.executable, "-m", "llmrpc.cli", "serve", str(gguf), "--host", "127.0.0.1",
        "--grpc-port", "0", "--port", "0",
    ]  # fmt: skip
    process = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    try:
        log = []
        for line in process.stderr:
            log.append(line)
            if "Converting" in line and "once" in line:
                break
        deadline = time.monotonic() + 60
        while not _leftovers(tmp_path) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _leftovers(tmp_path), "".join(log)  # the conversion is under way
        process.send_signal(signal.SIGTERM)
        process.communicate(timeout=120)
    finally:
        process.kill()
        process.wait()
    assert _leftovers(tmp_path) == []
    assert not (tmp_path / "converted" / loader.converted_dir(gguf, tmp_path).name).exists()


# An engine plug-in (imported before the model loads) standing in for a SIGTERM that lands just
# after the conversion's folder exists, before the code that would remove it runs.
_STOPPED_AT_CREATION = """
import tempfile
from llmrpc.engine.loading import loader


class _Stopped:
    @staticmethod
    def mkdtemp(*args, **kwargs):
        tempfile.mkdtemp(*args, **kwargs)
        raise SystemExit("stopped by SIGTERM while loading the model")


loader.tempfile = _Stopped
"""


def test_an_engine_stopped_as_its_conversion_folder_appears_leaves_none(tmp_path):
    """The engine process ends with os._exit (no at-exit handlers): it removes the folders its
    pid names as it ends, whatever point of the conversion the signal reached."""
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "stopped_at_creation.py").write_text(_STOPPED_AT_CREATION)
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        loader.CACHE_ENV: str(tmp_path),
        "LLMRPC_ENGINE_PLUGINS": "stopped_at_creation",
        "PYTHONPATH": os.pathsep.join([str(plugins), os.environ.get("PYTHONPATH", "")]),
    }
    command = [
        sys.executable, "-m", "llmrpc.cli", "serve", str(loader.packaged_gguf_path()),
        "--host", "127.0.0.1", "--grpc-port", "0", "--port", "0",
    ]  # fmt: skip
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stderr
    assert "stopped by SIGTERM while loading the model" in result.stderr
    assert _leftovers(tmp_path) == []
