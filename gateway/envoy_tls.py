"""TLS for the Envoy bootstrap: the front listener's (TLS or mTLS) and the upstream one's."""

from __future__ import annotations

from dataclasses import dataclass

TLS_SOCKET = "envoy.transport_sockets.tls"
_TLS_API = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3."

# Envoy's SubjectAltNameMatcher.SanType, by the prefix users write: "dns:client.example".
SAN_TYPES = {"dns": "DNS", "uri": "URI", "email": "EMAIL", "ip": "IP_ADDRESS"}


@dataclass(frozen=True)
class SanMatch:
    """One subject alternative name a client certificate may carry, matched exactly."""

    san_type: str  # a value of SAN_TYPES
    value: str

    @classmethod
    def parse(cls, text: str) -> SanMatch:
        """``TYPE:VALUE``, TYPE one of dns, uri, email, ip (``uri:spiffe://td/ns/x/sa/y``)."""
        kind, _, value = text.partition(":")
        if kind.lower() not in SAN_TYPES or not value:
            choices = ", ".join(SAN_TYPES)
            raise ValueError(f"--tls-client-san {text!r}: expected TYPE:VALUE, TYPE in {choices}")
        return cls(SAN_TYPES[kind.lower()], value)

    def to_envoy(self) -> dict:
        return {"san_type": self.san_type, "matcher": {"exact": self.value}}


@dataclass(frozen=True)
class FrontTls:
    """The listener's certificate; with ``client_ca_file``, client certificates are required
    (mTLS), and with ``client_sans``, one of those names must be in them."""

    cert_file: str | None
    key_file: str | None
    client_ca_file: str | None = None
    client_sans: tuple[SanMatch, ...] = ()

    def __post_init__(self) -> None:
        if self.client_sans and not self.client_ca_file:
            raise ValueError("--tls-client-san needs --tls-client-ca-file (mTLS)")
        if not (self.cert_file and self.key_file):
            raise ValueError("--tls-cert-file and --tls-key-file go together")


@dataclass(frozen=True)
class UpstreamTls:
    """TLS to the gRPC replicas, verified against ``ca_file``; ``cert_file``/``key_file`` make it
    mTLS; ``sni`` is sent and must be a DNS name in the replica's certificate."""

    ca_file: str
    cert_file: str | None = None
    key_file: str | None = None
    sni: str | None = None

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("--upstream-cert-file and --upstream-key-file go together")


def _certificate(cert_file: str, key_file: str) -> dict:
    return {"certificate_chain": {"filename": cert_file}, "private_key": {"filename": key_file}}


def _socket(kind: str, context: dict) -> dict:
    return {"name": TLS_SOCKET, "typed_config": {"@type": _TLS_API + kind, **context}}


def front_tls_socket(tls: FrontTls) -> dict:
    """A DownstreamTlsContext offering h2 (gRPC) and http/1.1 (REST) by ALPN."""
    common: dict = {
        "tls_certificates": [_certificate(tls.cert_file, tls.key_file)],
        "alpn_protocols": ["h2", "http/1.1"],
    }
    context: dict = {"common_tls_context": common}
    if tls.client_ca_file:
        validation: dict = {"trusted_ca": {"filename": tls.client_ca_file}}
        if tls.client_sans:
            validation["match_typed_subject_alt_names"] = [s.to_envoy() for s in tls.client_sans]
        common["validation_context"] = validation
        context["require_client_certificate"] = True
    return _socket("DownstreamTlsContext", context)


def upstream_tls_socket(tls: UpstreamTls) -> dict:
    """An UpstreamTlsContext speaking h2, verifying the replica against the CA (and SNI name)."""
    validation: dict = {"trusted_ca": {"filename": tls.ca_file}}
    common: dict = {"alpn_protocols": ["h2"], "validation_context": validation}
    if tls.cert_file and tls.key_file:
        common["tls_certificates"] = [_certificate(tls.cert_file, tls.key_file)]
    context: dict = {"common_tls_context": common}
    if tls.sni:
        context["sni"] = tls.sni
        validation["match_typed_subject_alt_names"] = [SanMatch("DNS", tls.sni).to_envoy()]
    return _socket("UpstreamTlsContext", context)
