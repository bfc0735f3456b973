"""``llmrpc k8s-manifests``: print Kubernetes manifests (YAML) for serving a model."""

from __future__ import annotations

import argparse
import sys

from llmrpc.common.args import OneLineErrorParser
from llmrpc.gateway.k8s import DEFAULT_IMAGE, PROBE_PERIOD_S, K8sOptions, build_manifests
from llmrpc.gateway.yaml_output import dump_documents

DESCRIPTION = """Print Kubernetes manifests on stdout: a Deployment running `llmrpc serve` with
gRPC startup/readiness/liveness probes on the plaintext health-only port, a headless Service
NAME-grpc for client-side balancing of the gRPC port (appProtocol: grpc), and a Service
NAME-http for the REST gateway. Apply with: kubectl apply -f FILE."""


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog="llmrpc k8s-manifests", description=DESCRIPTION)
    add = parser.add_argument
    add(
        "--image",
        default=DEFAULT_IMAGE,
        help="Container image with llmrpc installed, run as `llmrpc serve ARGS`. Default: "
        "%(default)s, what the repository's Dockerfile builds with `docker build -t "
        "%(default)s .` (load it into the cluster's nodes or push it to a registry they pull "
        "from, and pass that name).",
    )
    add(
        "--name",
        default="llmrpc",
        help="Name of the Deployment and prefix of the Services. Default: %(default)s.",
    )
    add("--namespace", help="Namespace of every object. Default: none (kubectl's).")
    add(
        "--model",
        help="Model to serve (a path in the image or on --model-pvc, or a name). "
        "Default: the server's packaged default.",
    )
    add("--replicas", type=int, default=2, help="Pods. Default: %(default)s.")
    add("--grpc-port", type=int, default=50051, help="gRPC port. Default: %(default)s.")
    add(
        "--health-port",
        type=int,
        default=50052,
        help="Plaintext health-only port, probed by Kubernetes. Default: %(default)s.",
    )
    add(
        "--http-port",
        type=int,
        default=8000,
        help="REST gateway port (llmrpc serve --port). Default: %(default)s.",
    )
    _add_resource_arguments(parser)
    _add_lifecycle_arguments(parser)
    return parser


def _add_resource_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--cpu", help="CPU request, e.g. 8 (no limit is set). Default: none.")
    add("--memory", help="Memory request and limit, e.g. 32Gi. Default: none.")
    add(
        "--model-pvc",
        metavar="CLAIM",
        help="PersistentVolumeClaim holding models, mounted read-only at --model-mount-path.",
    )
    add("--model-mount-path", default="/models", help="Default: %(default)s.")
    add(
        "--gateway-service-type",
        default="ClusterIP",
        choices=["ClusterIP", "NodePort", "LoadBalancer"],
        help="Type of the REST gateway's Service. Default: %(default)s.",
    )
    add(
        "--serve-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="One more argument for llmrpc serve (repeat; e.g. --serve-arg=--dtype=bfloat16).",
    )


def _add_lifecycle_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add(
        "--drain-delay",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="Seconds a stopping pod keeps serving while NOT_SERVING, for endpoints and "
        f"clients to catch up; at least the probe period ({PROBE_PERIOD_S} s). "
        "Default: %(default)s.",
    )
    add(
        "--shutdown-grace",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="Seconds calls in flight then get to finish. Default: %(default)s. The pod's "
        "terminationGracePeriodSeconds covers drain + grace.",
    )
    add(
        "--startup-timeout",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="Seconds a pod may take to load its model before it is restarted. "
        "Default: %(default)s.",
    )


def options_from_args(args: argparse.Namespace) -> K8sOptions:
    """Raises ValueError naming the flag for a bad value."""
    return K8sOptions(
        image=args.image,
        name=args.name,
        namespace=args.namespace,
        model=args.model,
        replicas=args.replicas,
        grpc_port=args.grpc_port,
        health_port=args.health_port,
        http_port=args.http_port,
        cpu=args.cpu,
        memory=args.memory,
        drain_delay_s=args.drain_delay,
        shutdown_grace_s=args.shutdown_grace,
        startup_timeout_s=args.startup_timeout,
        model_pvc=args.model_pvc,
        model_mount_path=args.model_mount_path,
        gateway_service_type=args.gateway_service_type,
        serve_args=tuple(args.serve_arg),
    )


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        options = options_from_args(args)
    except ValueError as error:
        parser.error(str(error))
    dump_documents(build_manifests(options), sys.stdout)
    return 0
