"""Target forms and connection options: what a client dials, and over what."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2_grpc

from llmrpc.clients import Client, ConnectionOptions


@pytest.mark.parametrize(
    ("target", "address", "tls"),
    [
        ("127.0.0.1:50051", "127.0.0.1:50051", False),
        ("grpc://example.test:443/", "example.test:443", False),
        ("grpcs://example.test:443", "example.test:443", True),
        ("unix:/run/llmrpc.sock", "unix:/run/llmrpc.sock", False),
        ("unix:///run/llmrpc.sock", "unix:///run/llmrpc.sock", False),
    ],
)
def test_target_forms(target, address, tls):
    options = ConnectionOptions(target=target)
    assert (options.address, options.uses_tls) == (address, tls)


def test_a_ca_or_client_certificate_turns_tls_on():
    assert ConnectionOptions(ca_cert="ca.pem").uses_tls
    assert ConnectionOptions(client_cert="c.pem", client_key="c.key").uses_tls


def test_client_certificate_and_key_go_together():
    with pytest.raises(ValueError, match="client_cert and client_key"):
        ConnectionOptions(client_cert="c.pem")


def test_the_api_key_and_request_id_travel_as_metadata():
    metadata = ConnectionOptions(api_key="k").metadata("r-1")
    assert metadata == (("authorization", "Bearer k"), ("x-request-id", "r-1"))
    assert ConnectionOptions().metadata() == ()


def test_a_unix_socket_target(tmp_path):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    socket = tmp_path / "llmrpc.sock"
    server.add_insecure_port(f"unix:{socket}")
    server.start()
    try:
        with Client(f"unix:{socket}") as client:
            assert client.health() == "SERVING"
    finally:
        server.stop(grace=None)
