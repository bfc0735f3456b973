"""The ``--ssl-*`` flags are checked once, by one function each, for the gRPC listener and the
REST listener alike: ``llmrpc serve`` and ``llmrpc gateway`` stop with the same line for the
same mistake, before binding anything (exit status 2)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.serialization import load_pem_private_key
from tls_certs import CertificateAuthority, Identity

from llmrpc.common.tls_files import check_tls_files, check_tls_flags


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> tuple[CertificateAuthority, Identity, Identity]:
    directory = tmp_path_factory.mktemp("pki")
    ca = CertificateAuthority(directory)
    return ca, ca.issue("server", server=True), ca.issue("other", server=True)


def flag_fault(**flags) -> str:
    values = {"keyfile": None, "certfile": None, "ca_certs": None, "cert_reqs": 0, "refresh": False}
    with pytest.raises(ValueError) as error:
        check_tls_flags(**{**values, **flags})
    return str(error.value)


def test_flag_combinations_that_cannot_work():
    assert flag_fault(certfile="c.pem") == (
        "--ssl-keyfile and --ssl-certfile go together: give both or neither"
    )
    assert flag_fault(keyfile="k", certfile="c", cert_reqs=3) == (
        "--ssl-cert-reqs must be 0, 1 or 2, got 3"
    )
    for flags, flag in (
        ({"ca_certs": "ca.pem"}, "--ssl-ca-certs"),
        ({"cert_reqs": 2}, "--ssl-cert-reqs"),
        ({"refresh": True}, "--enable-ssl-refresh"),
    ):
        assert flag_fault(**flags) == f"{flag} needs TLS: give --ssl-certfile and --ssl-keyfile"
    assert flag_fault(keyfile="k", certfile="c", cert_reqs=1) == (
        "--ssl-cert-reqs 1 needs --ssl-ca-certs to verify client certificates with"
    )


def file_fault(keyfile, certfile, ca_certs=None) -> str:
    with pytest.raises(ValueError) as error:
        check_tls_files(str(keyfile), str(certfile), None if ca_certs is None else str(ca_certs))
    return str(error.value)


def test_files_that_do_not_hold_what_they_should(pki, tmp_path):
    ca, server, other = pki
    check_tls_files(str(server.key), str(server.cert), str(ca.cert))  # all good: no error
    missing = tmp_path / "missing.pem"
    assert file_fault(server.key, missing) == (
        f"--ssl-certfile {missing}: cannot read it: No such file or directory"
    )
    assert file_fault(missing, server.cert) == (
        f"--ssl-keyfile {missing}: cannot read it: No such file or directory"
    )
    assert file_fault(server.key, server.cert, tmp_path) == (
        f"--ssl-ca-certs {tmp_path}: cannot read it: Is a directory"
    )
    assert file_fault(server.key, server.key) == (
        f"--ssl-certfile {server.key}: no certificate in it that OpenSSL can read (PEM)"
    )
    assert file_fault(other.key, server.cert) == (
        f"--ssl-keyfile {other.key} is not the key of --ssl-certfile {server.cert}"
    )
    assert file_fault(server.cert, server.cert) == (
        f"--ssl-keyfile {server.cert}: no private key in it that OpenSSL can read (PEM)"
    )
    assert file_fault(server.key, server.cert, server.key) == (
        f"--ssl-ca-certs {server.key}: no certificate in it that OpenSSL can read (PEM)"
    )


def test_an_encrypted_key_is_refused_without_asking_for_a_password(pki, tmp_path):
    _, server, _ = pki
    key = load_pem_private_key(server.key.read_bytes(), None)
    encrypted = tmp_path / "encrypted.key"
    encrypted.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"secret"),
        )
    )
    assert file_fault(encrypted, server.cert) == (
        f"--ssl-keyfile {encrypted}: the key is encrypted; give it unencrypted"
    )


def run_command(verb: str, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "llmrpc.cli", verb, *args]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        command, capture_output=True, text=True, timeout=120, env=env, stdin=subprocess.DEVNULL
    )


def the_error(verb: str, *args: str) -> str:
    """The one stderr line of a command that must refuse its flags, without "llmrpc VERB: "."""
    done = run_command(verb, *args)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    prefix = f"llmrpc {verb}: error: "
    assert lines[0].startswith(prefix), done.stderr
    return lines[0].removeprefix(prefix)


def tls_faults(ca: CertificateAuthority, server: Identity, other: Identity, missing: Path):
    key, cert = str(server.key), str(server.cert)
    return {
        "no CA for client certificates": (
            ["--ssl-keyfile", key, "--ssl-certfile", cert, "--ssl-cert-reqs", "2"],
            "--ssl-cert-reqs 2 needs --ssl-ca-certs to verify client certificates with",
        ),
        "a CA without TLS": (
            ["--ssl-ca-certs", str(ca.cert)],
            "--ssl-ca-certs needs TLS: give --ssl-certfile and --ssl-keyfile",
        ),
        "a missing certificate": (
            ["--ssl-keyfile", key, "--ssl-certfile", str(missing)],
            f"--ssl-certfile {missing}: cannot read it: No such file or directory",
        ),
        "another certificate's key": (
            ["--ssl-keyfile", str(other.key), "--ssl-certfile", cert],
            f"--ssl-keyfile {other.key} is not the key of --ssl-certfile {cert}",
        ),
    }


def test_serve_and_gateway_refuse_the_same_mistake_with_the_same_line(
    pki, tmp_path, tiny_llama_dir
):
    ca, server, other = pki
    for name, (args, message) in tls_faults(ca, server, other, tmp_path / "missing").items():
        served = the_error(
            "serve", str(tiny_llama_dir), "--load-format", "dummy", "--grpc-port", "0",
            "--port", "0", *args,
        )  # fmt: skip
        gateway = the_error("gateway", "--backend", "127.0.0.1:1", "--port", "0", *args)
        assert served == gateway == message, name
