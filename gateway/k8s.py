"""Kubernetes manifests for ``llmrpc serve``: a Deployment, a headless Service for the gRPC port
(clients balance over the pods themselves: one HTTP/2 connection would pin one pod behind a
ClusterIP), and a Service for the REST gateway.

Probes are gRPC probes on the plaintext health-only port (``--health-port``): Kubernetes gRPC
probes cannot use TLS, whatever the gRPC port serves. On SIGTERM the server itself turns
NOT_SERVING and keeps serving for ``--drain-delay`` while endpoints and clients catch up, then
gives calls in flight ``--shutdown-grace``: no preStop hook is needed, and the termination grace
period covers both.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

# A Service name (RFC 1035 label); the Services add suffixes to it.
_NAME = re.compile(r"[a-z]([-a-z0-9]{0,40}[a-z0-9])?")
CONTAINER = "llmrpc"
# What the repository's Dockerfile says to build (`docker build -t llmrpc:0.1.0 .`): the package
# version as the tag. Its entrypoint is the container's command below, `llmrpc serve`.
DEFAULT_IMAGE = "llmrpc:0.1.0"
PROBE_PERIOD_S = 5
# Past drain + grace, the process still needs a moment to stop the engine and exit.
EXIT_MARGIN_S = 5


@dataclass(frozen=True)
class K8sOptions:
    image: str = DEFAULT_IMAGE
    name: str = "llmrpc"
    namespace: str | None = None
    model: str | None = None  # None: the server's packaged default model
    replicas: int = 2
    grpc_port: int = 50051
    health_port: int = 50052
    http_port: int = 8000
    cpu: str | None = None
    memory: str | None = None
    drain_delay_s: float = 10.0
    shutdown_grace_s: float = 30.0
    startup_timeout_s: float = 600.0  # model download or conversion, load and warm-up
    model_pvc: str | None = None
    model_mount_path: str = "/models"
    gateway_service_type: str = "ClusterIP"
    serve_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not _NAME.fullmatch(self.name):
            raise ValueError(f"--name {self.name!r}: lowercase letters, digits and '-', at most 42")
        ports = (self.grpc_port, self.health_port, self.http_port)
        if not all(1 <= port <= 65535 for port in ports):
            raise ValueError("--grpc-port, --health-port and --http-port must be 1 to 65535")
        if len(set(ports)) != 3:
            raise ValueError("--grpc-port, --health-port and --http-port must differ")
        if self.replicas < 0:
            raise ValueError("--replicas must be 0 or more")
        if self.drain_delay_s < PROBE_PERIOD_S:
            raise ValueError(
                f"--drain-delay must be at least the readiness probe period ({PROBE_PERIOD_S} s)"
            )

    @property
    def labels(self) -> dict[str, str]:
        return {"app.kubernetes.io/name": "llmrpc", "app.kubernetes.io/instance": self.name}

    @property
    def grpc_service_name(self) -> str:
        return f"{self.name}-grpc"

    @property
    def gateway_service_name(self) -> str:
        return f"{self.name}-http"


def build_manifests(options: K8sOptions) -> list[dict]:
    return [deployment(options), grpc_service(options), gateway_service(options)]


def _metadata(options: K8sOptions, name: str) -> dict:
    metadata: dict = {"name": name, "labels": options.labels}
    if options.namespace:
        metadata["namespace"] = options.namespace
    return metadata


def serve_args(options: K8sOptions) -> list[str]:
    """The arguments after ``llmrpc serve``."""
    args = [options.model] if options.model else []
    args += ["--grpc-port", str(options.grpc_port), "--health-port", str(options.health_port)]
    args += ["--port", str(options.http_port)]
    args += ["--drain-delay", f"{options.drain_delay_s:g}"]
    args += ["--shutdown-grace", f"{options.shutdown_grace_s:g}"]
    return [*args, *options.serve_args]


def termination_grace_s(options: K8sOptions) -> int:
    return math.ceil(options.drain_delay_s + options.shutdown_grace_s + EXIT_MARGIN_S)


def _probe(options: K8sOptions, failure_threshold: int, timeout_s: int) -> dict:
    # A grpc probe's port is a number (named ports are not allowed there).
    return {
        "grpc": {"port": options.health_port},
        "periodSeconds": PROBE_PERIOD_S,
        "timeoutSeconds": timeout_s,
        "failureThreshold": failure_threshold,
    }


def probes(options: K8sOptions) -> dict:
    startup_failures = max(1, math.ceil(options.startup_timeout_s / PROBE_PERIOD_S))
    # Health says NOT_SERVING for the whole drain and grace: liveness must outlast them, or a
    # stopping pod would be killed with calls in flight.
    liveness_failures = math.ceil(termination_grace_s(options) / PROBE_PERIOD_S) + 1
    return {
        # Liveness and readiness wait for this: a model may take minutes to load.
        "startupProbe": _probe(options, startup_failures, timeout_s=2),
        # One NOT_SERVING answer takes the pod out of the Services.
        "readinessProbe": _probe(options, 1, timeout_s=2),
        "livenessProbe": _probe(options, liveness_failures, timeout_s=5),
    }


def resources(options: K8sOptions) -> dict:
    requests: dict = {}
    limits: dict = {}
    if options.cpu:
        requests["cpu"] = options.cpu  # no CPU limit: throttling stalls every stream at once
    if options.memory:
        requests["memory"] = limits["memory"] = options.memory
    return {key: value for key, value in (("requests", requests), ("limits", limits)) if value}


def container(options: K8sOptions) -> dict:
    spec: dict = {
        "name": CONTAINER,
        "image": options.image,
        "command": ["llmrpc", "serve"],
        "args": serve_args(options),
        "ports": [
            {"name": "grpc", "containerPort": options.grpc_port, "protocol": "TCP"},
            {"name": "grpc-health", "containerPort": options.health_port, "protocol": "TCP"},
            {"name": "http", "containerPort": options.http_port, "protocol": "TCP"},
        ],
        **probes(options),
    }
    if resources(options):
        spec["resources"] = resources(options)
    if options.model_pvc:
        mount = {"name": "models", "mountPath": options.model_mount_path, "readOnly": True}
        spec["volumeMounts"] = [mount]
    return spec


def deployment(options: K8sOptions) -> dict:
    pod_spec: dict = {
        "terminationGracePeriodSeconds": termination_grace_s(options),
        "containers": [container(options)],
    }
    if options.model_pvc:
        claim = {"claimName": options.model_pvc, "readOnly": True}
        pod_spec["volumes"] = [{"name": "models", "persistentVolumeClaim": claim}]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(options, options.name),
        "spec": {
            "replicas": options.replicas,
            "selector": {"matchLabels": options.labels},
            # Never below the wanted capacity while new pods load their model.
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1},
            },
            "template": {"metadata": {"labels": options.labels}, "spec": pod_spec},
        },
    }


def grpc_service(options: K8sOptions) -> dict:
    """Headless: DNS answers every ready pod's address, for clients' round-robin (or Envoy's
    STRICT_DNS cluster) to spread HTTP/2 connections over."""
    port = {
        "name": "grpc",
        "port": options.grpc_port,
        "targetPort": "grpc",
        "protocol": "TCP",
        "appProtocol": "grpc",
    }
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(options, options.grpc_service_name),
        "spec": {"clusterIP": "None", "selector": options.labels, "ports": [port]},
    }


def gateway_service(options: K8sOptions) -> dict:
    port = {
        "name": "http",
        "port": options.http_port,
        "targetPort": "http",
        "protocol": "TCP",
        "appProtocol": "http",
    }
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(options, options.gateway_service_name),
        "spec": {"type": options.gateway_service_type, "selector": options.labels, "ports": [port]},
    }
