"""TLS and mutual TLS on the gRPC port, with certificates made here: grpcurl and the Python stubs,
--ssl-cert-reqs 0/1/2, certificate refresh, and the plaintext health-only port."""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from server_utils import bound_server, grpcurl
from tls_certs import CertificateAuthority, Identity

from llmrpc.server.settings import TLSConfig
from llmrpc.v1 import admin_pb2, admin_pb2_grpc, generation_pb2, generation_pb2_grpc

# Each channel its own connection, so a new channel means a new TLS handshake.
CHANNEL_OPTIONS = (("grpc.use_local_subchannel_pool", 1),)


@dataclass(frozen=True)
class Pki:
    ca: CertificateAuthority
    server: Identity
    client: Identity
    other_ca: CertificateAuthority  # signs a stranger client and a replacement server cert
    stranger: Identity
    other_server: Identity


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    directory = tmp_path_factory.mktemp("pki")
    ca = CertificateAuthority(directory, "test CA")
    other_ca = CertificateAuthority(directory, "other CA")
    return Pki(
        ca=ca,
        server=ca.issue("server", server=True),
        client=ca.issue("client", server=False),
        other_ca=other_ca,
        stranger=other_ca.issue("stranger", server=False),
        other_server=other_ca.issue("other-server", server=True),
    )


def tls(pki: Pki, cert_reqs: int = 0, refresh: bool = False, server: Identity | None = None):
    server = server or pki.server
    ca_certs = str(pki.ca.cert) if cert_reqs else None
    return TLSConfig(str(server.key), str(server.cert), ca_certs, cert_reqs, refresh)


async def server_info(port: int, trusted: CertificateAuthority, client: Identity | None = None):
    """GetServerInfo over a new TLS connection; the status code if it fails."""
    credentials = grpc.ssl_channel_credentials(
        root_certificates=trusted.cert_pem,
        private_key=client.key_pem if client else None,
        certificate_chain=client.cert_pem if client else None,
    )
    target = f"127.0.0.1:{port}"
    async with grpc.aio.secure_channel(target, credentials, options=CHANNEL_OPTIONS) as channel:
        try:
            stub = admin_pb2_grpc.AdminServiceStub(channel)
            return await stub.GetServerInfo(admin_pb2.GetServerInfoRequest(), timeout=10)
        except grpc.aio.AioRpcError as error:
            return error.code()


async def test_tls_serves_the_python_stubs_and_grpcurl_and_refuses_plaintext(pki):
    async with bound_server(tls=tls(pki)) as running:
        info = await server_info(running.port, pki.ca)
        assert info.capabilities.tls
        assert await server_info(running.port, pki.other_ca) == grpc.StatusCode.UNAVAILABLE
        address = f"127.0.0.1:{running.port}"
        rc, out, err = await grpcurl("-cacert", str(pki.ca.cert), address, "list")
        assert rc == 0, err
        assert "llmrpc.v1.GenerationService" in out.split()
        rc, _, _ = await grpcurl("-plaintext", address, "list")
        assert rc != 0


async def test_mutual_tls_serves_only_clients_with_a_certificate_from_the_ca(pki):
    async with bound_server(tls=tls(pki, cert_reqs=2)) as running:
        assert await server_info(running.port, pki.ca) == grpc.StatusCode.UNAVAILABLE
        stranger = await server_info(running.port, pki.ca, pki.stranger)
        assert stranger == grpc.StatusCode.UNAVAILABLE
        assert (await server_info(running.port, pki.ca, pki.client)).capabilities.tls
        address = f"127.0.0.1:{running.port}"
        cacert = ("-cacert", str(pki.ca.cert))
        rc, _, _ = await grpcurl(*cacert, address, "list")
        assert rc != 0
        client = ("-cert", str(pki.client.cert), "-key", str(pki.client.key))
        method = "llmrpc.v1.AdminService/GetServerInfo"
        rc, out, err = await grpcurl(*cacert, *client, address, method)
        assert rc == 0, err
        assert json.loads(out)["capabilities"]["tls"]


async def test_optional_client_certificates_are_served_as_not_asked_with_a_warning(pki, caplog):
    with caplog.at_level(logging.WARNING):
        async with bound_server(tls=tls(pki, cert_reqs=1)) as running:
            assert (await server_info(running.port, pki.ca)).capabilities.tls
            assert (await server_info(running.port, pki.ca, pki.client)).capabilities.tls
    assert any("--ssl-cert-reqs 1" in r.getMessage() for r in caplog.records)


def replace_atomically(source: Path, target: Path) -> None:
    staged = target.with_suffix(".staged")
    shutil.copyfile(source, staged)
    os.replace(staged, target)


@pytest.mark.parametrize("refresh", [True, False])
async def test_replaced_certificate_reaches_new_connections_with_refresh(pki, tmp_path, refresh):
    live = Identity(tmp_path / "live.pem", tmp_path / "live.key")
    shutil.copyfile(pki.server.cert, live.cert)
    shutil.copyfile(pki.server.key, live.key)
    async with bound_server(tls=tls(pki, refresh=refresh, server=live)) as running:
        assert await server_info(running.port, pki.other_ca) == grpc.StatusCode.UNAVAILABLE
        replace_atomically(pki.other_server.key, live.key)
        replace_atomically(pki.other_server.cert, live.cert)
        after = await server_info(running.port, pki.other_ca)
        if refresh:
            assert after.capabilities.tls
            assert await server_info(running.port, pki.ca) == grpc.StatusCode.UNAVAILABLE
        else:
            assert after == grpc.StatusCode.UNAVAILABLE


async def test_a_key_that_is_not_the_certificates_stops_start_up_naming_the_flag(pki):
    mismatched = TLSConfig(str(pki.client.key), str(pki.server.cert))
    with pytest.raises(ValueError, match="--ssl-certfile"):
        async with bound_server(tls=mismatched):
            pass


async def test_health_port_answers_health_in_plaintext_beside_tls(pki):
    async with bound_server(tls=tls(pki), health_port=0) as running:
        address = f"127.0.0.1:{running.health_port}"
        async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            watch = health.Watch(health_pb2.HealthCheckRequest())
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
            await running.health.set_serving(True)
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
            request = health_pb2.HealthCheckRequest(service="llmrpc.v1.GenerationService")
            assert (await health.Check(request)).status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.aio.AioRpcError) as failure:
                generation = generation_pb2_grpc.GenerationServiceStub(channel)
                await generation.Generate(generation_pb2.GenerateRequest(text="hi"))
            assert failure.value.code() == grpc.StatusCode.UNIMPLEMENTED
            watch.cancel()
