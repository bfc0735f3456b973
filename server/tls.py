"""TLS for the gRPC listener: ``--ssl-*`` flags to server credentials, with certificate refresh.

Files are checked at start-up by ``llmrpc.common.tls_files`` (the REST gateway's check too), so
a mistake stops the server with a line naming the flag instead of failing every handshake
later. With ``--enable-ssl-refresh`` gRPC asks, at each new connection's handshake,
for a newer certificate configuration; the files are re-read only when one of them changed.
"""

from __future__ import annotations

import logging
import os

import grpc

from llmrpc.common.tls_files import check_tls_files
from llmrpc.server.settings import TLSConfig

logger = logging.getLogger(__name__)

CERT_REQUIRED = 2


class CertificateFiles:
    """The key, certificate and CA files of ``--ssl-*``, and when they last changed."""

    def __init__(self, tls: TLSConfig) -> None:
        self.tls = tls
        self._stamp = self._stat()

    def _paths(self) -> list[str]:
        return [path for path in (self.tls.keyfile, self.tls.certfile, self.tls.ca_certs) if path]

    def _stat(self) -> tuple | None:
        try:
            return tuple((s.st_mtime_ns, s.st_size, s.st_ino) for s in map(os.stat, self._paths()))
        except OSError:  # mid-replacement: a file is missing for a moment
            return None

    def load(self) -> grpc.ServerCertificateConfiguration:
        """ValueError naming the flag if a file is missing, unparsable, or key and cert differ."""
        tls = self.tls
        check_tls_files(tls.keyfile, tls.certfile, tls.ca_certs)
        with open(tls.keyfile, "rb") as key, open(tls.certfile, "rb") as cert:
            pair = (key.read(), cert.read())
        root = None
        if tls.ca_certs:
            with open(tls.ca_certs, "rb") as ca:
                root = ca.read()
        return grpc.ssl_server_certificate_configuration([pair], root_certificates=root)

    def fetch_if_changed(self) -> grpc.ServerCertificateConfiguration | None:
        """gRPC's certificate-configuration fetcher: a new configuration, or None for no change.

        Runs on a gRPC thread at each handshake, so it must never raise: a bad replacement is
        logged and the current certificate stays in use until the files change again.
        """
        stamp = self._stat()
        if stamp is None or stamp == self._stamp:
            return None
        self._stamp = stamp
        try:
            configuration = self.load()
        except Exception as error:  # noqa: BLE001 - see above
            logger.warning("keeping the current TLS certificate: %s", error)
            return None
        logger.info(
            "TLS: serving the replaced certificate %s to new connections", self.tls.certfile
        )
        return configuration


def server_credentials(tls: TLSConfig) -> grpc.ServerCredentials:
    """Credentials for ``add_secure_port``; ValueError naming the flag if a file is wrong."""
    files = CertificateFiles(tls)
    configuration = files.load()
    if tls.cert_reqs == 1:
        logger.warning(
            "--ssl-cert-reqs 1: gRPC servers can only require client certificates (2) or not "
            "ask for them (0); serving as 0: client certificates are neither asked for nor checked"
        )
    require = tls.cert_reqs == CERT_REQUIRED
    fetch = files.fetch_if_changed if tls.refresh else lambda: None
    return grpc.dynamic_ssl_server_credentials(
        configuration, fetch, require_client_authentication=require
    )
