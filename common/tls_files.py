"""``--ssl-keyfile``, ``--ssl-certfile``, ``--ssl-ca-certs``, ``--ssl-cert-reqs`` and
``--enable-ssl-refresh``: which combinations make sense, and whether the files hold what they
should. The gRPC listener and the REST listener take the same flags and get the same checks.

The files are checked with the standard ``ssl`` module (the certificate parses, the key is its
key, the CA file holds certificates), so a mistake stops start-up with one line naming the flag
instead of failing every handshake later.
"""

from __future__ import annotations

import ssl

CERT_REQS = (0, 1, 2)  # ssl.CERT_NONE, CERT_OPTIONAL, CERT_REQUIRED, as vLLM numbers them


def check_tls_flags(
    keyfile: str | None,
    certfile: str | None,
    ca_certs: str | None,
    cert_reqs: int,
    refresh: bool,
) -> None:
    """ValueError naming the flag for a combination that cannot work; files are not read."""
    if (keyfile is None) != (certfile is None):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together: give both or neither")
    if cert_reqs not in CERT_REQS:
        raise ValueError(f"--ssl-cert-reqs must be 0, 1 or 2, got {cert_reqs}")
    if certfile is None:
        for flag, value in (
            ("--ssl-ca-certs", ca_certs),
            ("--ssl-cert-reqs", cert_reqs),
            ("--enable-ssl-refresh", refresh),
        ):
            if value:
                raise ValueError(f"{flag} needs TLS: give --ssl-certfile and --ssl-keyfile")
    if cert_reqs and ca_certs is None:
        raise ValueError(
            f"--ssl-cert-reqs {cert_reqs} needs --ssl-ca-certs to verify client certificates with"
        )


class _EncryptedKey(Exception):
    pass


def _no_password() -> bytes:
    # Called by OpenSSL only for an encrypted key; without it OpenSSL would prompt on the
    # terminal and start-up would hang.
    raise _EncryptedKey


def check_tls_files(keyfile: str, certfile: str, ca_certs: str | None) -> None:
    """ValueError naming the flag if a file cannot be read or does not hold what it should."""
    named = (("--ssl-certfile", certfile), ("--ssl-keyfile", keyfile), ("--ssl-ca-certs", ca_certs))
    for flag, path in named:
        if path is not None:
            _check_readable(flag, path)
    _check_certificates("--ssl-certfile", certfile)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(certfile, keyfile, password=_no_password)
    except _EncryptedKey:
        raise ValueError(
            f"--ssl-keyfile {keyfile}: the key is encrypted; give it unencrypted"
        ) from None
    except ssl.SSLError as error:
        if error.reason == "KEY_VALUES_MISMATCH":
            raise ValueError(
                f"--ssl-keyfile {keyfile} is not the key of --ssl-certfile {certfile}"
            ) from None
        raise ValueError(
            f"--ssl-keyfile {keyfile}: no private key in it that OpenSSL can read (PEM)"
        ) from None
    if ca_certs is not None:
        _check_certificates("--ssl-ca-certs", ca_certs)


def _check_readable(flag: str, path: str) -> None:
    try:
        with open(path, "rb"):
            pass
    except OSError as error:
        raise ValueError(f"{flag} {path}: cannot read it: {error.strerror or error}") from None


def _check_certificates(flag: str, path: str) -> None:
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=path)
    except (ssl.SSLError, OSError):
        raise ValueError(
            f"{flag} {path}: no certificate in it that OpenSSL can read (PEM)"
        ) from None
