"""``llmrpc envoy-config``: print an Envoy v3 bootstrap (YAML) for llmrpc replicas."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from llmrpc.common.args import OneLineErrorParser
from llmrpc.gateway.descriptors import api_descriptor_set_bytes
from llmrpc.gateway.envoy import Endpoint, EnvoyOptions, HealthCheck, build_bootstrap
from llmrpc.gateway.envoy_tls import FrontTls, SanMatch, UpstreamTls
from llmrpc.gateway.yaml_output import dump_documents

DESCRIPTION = """Print an Envoy v3 bootstrap (YAML) on stdout: native gRPC to the --backend
replicas (HTTP/2, gRPC health checks, least-request balancing), the same API as JSON through
grpc_json_transcoder (POST /v1/generate; /v1/generate:stream as SSE), and the OpenAI paths to
the --gateway replicas. Run it with: envoy -c FILE."""


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog="llmrpc envoy-config", description=DESCRIPTION)
    _add_routing_arguments(parser)
    _add_front_tls_arguments(parser.add_argument_group("front listener TLS"))
    _add_upstream_tls_arguments(parser.add_argument_group("TLS to the gRPC replicas"))
    _add_health_arguments(parser.add_argument_group("health checks"))
    return parser


def _add_routing_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add(
        "--backend",
        action="append",
        required=True,
        metavar="HOST:PORT",
        help="A gRPC replica (llmrpc serve --grpc-port); repeat for each. A DNS name (e.g. a "
        "headless Service) stands for every address it resolves to.",
    )
    add(
        "--gateway",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="An OpenAI-compatible REST gateway; repeat for each. Without one, the OpenAI "
        "paths (/v1/chat/completions...) are not routed.",
    )
    add(
        "--listen",
        default="0.0.0.0:8080",
        metavar="HOST:PORT",
        help="Address of the front listener (gRPC and REST). Default: %(default)s.",
    )
    add(
        "--admin-port",
        type=int,
        default=9901,
        metavar="PORT",
        help="Port of Envoy's admin interface, on 127.0.0.1 only. Default: %(default)s.",
    )
    add(
        "--cors-allowed-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="An origin browsers may call from (exact, or * for any); repeat for each. "
        "Default: none (no CORS headers).",
    )
    add(
        "--descriptor-out",
        metavar="PATH",
        help="Write the API's descriptor set to PATH and refer to it by path. Default: inline "
        "in the YAML (proto_descriptor_bin).",
    )
    add(
        "--stream-idle-timeout",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="Close a stream that sends nothing for this long. Default: %(default)s.",
    )
    add(
        "--max-requests",
        type=int,
        default=4096,
        metavar="N",
        help="Most requests in flight per cluster (Envoy's circuit breaker). Default: %(default)s.",
    )
    add(
        "--panic-threshold",
        type=float,
        default=0.0,
        metavar="PERCENT",
        help="Below this share of healthy replicas, route to unhealthy ones too (Envoy's panic "
        "mode). Default: %(default)s (never).",
    )


def _add_front_tls_arguments(group: argparse._ArgumentGroup) -> None:
    add = group.add_argument
    add("--tls-cert-file", metavar="PEM", help="Certificate chain of the front listener: TLS.")
    add("--tls-key-file", metavar="PEM", help="Private key of --tls-cert-file.")
    add(
        "--tls-client-ca-file",
        metavar="PEM",
        help="CA that client certificates must chain to: mTLS, clients without one refused.",
    )
    add(
        "--tls-client-san",
        action="append",
        default=[],
        metavar="TYPE:VALUE",
        help="A subject alternative name the client certificate must carry (one of those "
        "given), TYPE one of dns, uri, email, ip: e.g. uri:spiffe://cluster.local/ns/x/sa/y.",
    )


def _add_upstream_tls_arguments(group: argparse._ArgumentGroup) -> None:
    add = group.add_argument
    add(
        "--upstream-ca-file",
        metavar="PEM",
        help="CA the replicas' certificates chain to: TLS to the replicas.",
    )
    add("--upstream-cert-file", metavar="PEM", help="Client certificate for the replicas: mTLS.")
    add("--upstream-key-file", metavar="PEM", help="Private key of --upstream-cert-file.")
    add(
        "--upstream-sni",
        metavar="NAME",
        help="Server name sent to the replicas; their certificate must carry it (DNS SAN).",
    )


def _add_health_arguments(group: argparse._ArgumentGroup) -> None:
    add = group.add_argument
    add(
        "--health-check-service",
        default="",
        metavar="NAME",
        help="grpc.health.v1 service name checked on each replica. Default: '' (the server).",
    )
    add(
        "--health-check-interval",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="Seconds between health checks. Default: %(default)s.",
    )
    add(
        "--health-check-timeout",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="Seconds a health check may take. Default: %(default)s.",
    )
    add(
        "--unhealthy-threshold",
        type=int,
        default=2,
        metavar="N",
        help="Failed checks in a row that take a replica out. Default: %(default)s.",
    )
    add(
        "--healthy-threshold",
        type=int,
        default=1,
        metavar="N",
        help="Passed checks in a row that bring a replica back. Default: %(default)s.",
    )
    add(
        "--gateway-health-path",
        default="/health",
        metavar="PATH",
        help="HTTP path checked on each --gateway. Default: %(default)s.",
    )


def _front_tls(args: argparse.Namespace) -> FrontTls | None:
    given = (args.tls_cert_file, args.tls_key_file, args.tls_client_ca_file, args.tls_client_san)
    if not any(given):
        return None
    sans = tuple(SanMatch.parse(text) for text in args.tls_client_san)
    return FrontTls(args.tls_cert_file, args.tls_key_file, args.tls_client_ca_file, sans)


def _upstream_tls(args: argparse.Namespace) -> UpstreamTls | None:
    if args.upstream_ca_file is None:
        if args.upstream_cert_file or args.upstream_key_file or args.upstream_sni:
            raise ValueError(
                "--upstream-cert-file/--upstream-key-file/--upstream-sni need "
                "--upstream-ca-file (TLS to the replicas)"
            )
        return None
    return UpstreamTls(
        args.upstream_ca_file, args.upstream_cert_file, args.upstream_key_file, args.upstream_sni
    )


def options_from_args(args: argparse.Namespace) -> EnvoyOptions:
    """Raises ValueError naming the flag for a bad value."""
    health = HealthCheck(
        service_name=args.health_check_service,
        interval_s=args.health_check_interval,
        timeout_s=args.health_check_timeout,
        unhealthy_threshold=args.unhealthy_threshold,
        healthy_threshold=args.healthy_threshold,
        gateway_path=args.gateway_health_path,
    )
    return EnvoyOptions(
        backends=tuple(Endpoint.parse(text, "--backend") for text in args.backend),
        gateways=tuple(Endpoint.parse(text, "--gateway") for text in args.gateway),
        listen=Endpoint.parse(args.listen, "--listen"),
        admin_port=args.admin_port,
        front_tls=_front_tls(args),
        upstream_tls=_upstream_tls(args),
        health_check=health,
        cors_origins=tuple(args.cors_allowed_origin),
        descriptor_path=str(Path(args.descriptor_out).resolve()) if args.descriptor_out else None,
        stream_idle_timeout_s=args.stream_idle_timeout,
        max_requests=args.max_requests,
        panic_threshold_percent=args.panic_threshold,
    )


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        options = options_from_args(args)
    except ValueError as error:
        parser.error(str(error))
    if options.descriptor_path is not None:
        Path(options.descriptor_path).write_bytes(api_descriptor_set_bytes())
    dump_documents([build_bootstrap(options)], sys.stdout)
    return 0
