"""Test certificates: a CA, a server certificate it signs for 127.0.0.1, localhost and
llmrpc.test, and a client certificate for mTLS, written as PEM files (EC P-256: quick to make)."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

SERVER_NAMES = ("localhost", "llmrpc.test")


@dataclass(frozen=True)
class Certificates:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> Path:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return path


def _write_cert(cert: x509.Certificate, path: Path) -> Path:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


def _builder(subject: str, issuer: str, public_key) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(_name(issuer))
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
    )


def make_certificates(folder: Path) -> Certificates:
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = (
        _builder("llmrpc test CA", "llmrpc test CA", ca_key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )

    def leaf(name: str, usage, names: x509.SubjectAlternativeName | None):
        key = ec.generate_private_key(ec.SECP256R1())
        builder = _builder(name, "llmrpc test CA", key.public_key()).add_extension(
            x509.ExtendedKeyUsage([usage]), critical=False
        )
        if names is not None:
            builder = builder.add_extension(names, critical=False)
        return key, builder.sign(ca_key, hashes.SHA256())

    server_names = x509.SubjectAlternativeName(
        [x509.DNSName(n) for n in SERVER_NAMES]
        + [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    )
    server_key, server_cert = leaf("server", ExtendedKeyUsageOID.SERVER_AUTH, server_names)
    client_key, client_cert = leaf("client", ExtendedKeyUsageOID.CLIENT_AUTH, None)
    return Certificates(
        ca=_write_cert(ca_cert, folder / "ca.pem"),
        server_cert=_write_cert(server_cert, folder / "server.pem"),
        server_key=_write_key(server_key, folder / "server.key"),
        client_cert=_write_cert(client_cert, folder / "client.pem"),
        client_key=_write_key(client_key, folder / "client.key"),
    )
