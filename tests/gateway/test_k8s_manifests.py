"""``llmrpc k8s-manifests``: structurally sound Kubernetes YAML (no cluster here): names and
selectors agree, probes hit the health-only port, the container's arguments are flags
``llmrpc serve`` accepts, and the termination grace covers the drain."""

from __future__ import annotations

import contextlib
import io

import pytest
import yaml

from llmrpc.cli import build_parser
from llmrpc.gateway import k8s_cli
from llmrpc.server import options as serve_options

IMAGE = "registry.example/llmrpc:0.1"


def manifests(*args: str) -> dict[str, dict]:
    """kind/name -> object, from the CLI's YAML."""
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        assert k8s_cli.main(["--image", IMAGE, *args]) == 0
    documents = list(yaml.safe_load_all(output.getvalue()))
    return {f"{d['kind']}/{d['metadata']['name']}": d for d in documents}


def _container(objects: dict[str, dict], name: str = "llmrpc") -> dict:
    pod = objects[f"Deployment/{name}"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    return container


def _port_numbers(container: dict) -> dict[str, int]:
    return {port["name"]: port["containerPort"] for port in container["ports"]}


def test_objects_and_selectors_agree():
    objects = manifests("--name", "chat")
    assert set(objects) == {"Deployment/chat", "Service/chat-grpc", "Service/chat-http"}
    deployment = objects["Deployment/chat"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"] == labels
    for service in ("Service/chat-grpc", "Service/chat-http"):
        assert objects[service]["spec"]["selector"] == labels
    for port in (
        *objects["Service/chat-grpc"]["spec"]["ports"],
        *objects["Service/chat-http"]["spec"]["ports"],
    ):
        assert port["targetPort"] in _port_numbers(_container(objects, "chat"))


def test_grpc_service_is_headless_with_grpc_app_protocol():
    objects = manifests("--grpc-port", "9000")
    spec = objects["Service/llmrpc-grpc"]["spec"]
    assert spec["clusterIP"] == "None"
    (port,) = spec["ports"]
    assert (port["port"], port["targetPort"], port["appProtocol"]) == (9000, "grpc", "grpc")
    assert _port_numbers(_container(objects))["grpc"] == 9000


def test_probes_are_grpc_on_the_health_only_port():
    container = _container(manifests("--health-port", "7001"))
    assert _port_numbers(container)["grpc-health"] == 7001
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"] == {"port": 7001}, probe
    args = container["args"]
    assert args[args.index("--health-port") + 1] == "7001"


def test_container_arguments_are_flags_llmrpc_serve_accepts():
    container = _container(
        manifests(
            *["--model", "/models/smol", "--grpc-port", "6000", "--health-port", "6001"],
            *["--drain-delay", "12", "--shutdown-grace", "40", "--serve-arg=--dtype=float32"],
        )
    )
    assert container["command"] == ["llmrpc", "serve"]
    _, serve_parser = build_parser()
    values = serve_options.parse_serve_values(serve_parser, container["args"])
    engine_config, frontend = serve_options.configs_or_exit(serve_parser, values)
    assert engine_config.model.model == "/models/smol"
    assert engine_config.model.dtype == "float32"
    assert (frontend.grpc_port, frontend.health_port) == (6000, 6001)
    assert (frontend.drain_delay_s, frontend.shutdown_grace_s) == (12.0, 40.0)


def test_termination_grace_and_liveness_outlast_drain_and_grace():
    objects = manifests("--drain-delay", "20", "--shutdown-grace", "60")
    pod = objects["Deployment/llmrpc"]["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] >= 80
    liveness = pod["containers"][0]["livenessProbe"]
    assert liveness["periodSeconds"] * liveness["failureThreshold"] > 80
    assert pod["containers"][0]["readinessProbe"]["failureThreshold"] == 1


def test_startup_probe_allows_the_startup_timeout():
    startup = _container(manifests("--startup-timeout", "900"))["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 900


def test_resources_model_volume_and_namespace():
    objects = manifests(
        *["--namespace", "ai", "--cpu", "8", "--memory", "32Gi"],
        *["--model-pvc", "weights", "--model-mount-path", "/w"],
    )
    assert {o["metadata"]["namespace"] for o in objects.values()} == {"ai"}
    container = _container(objects)
    assert container["resources"] == {
        "requests": {"cpu": "8", "memory": "32Gi"},
        "limits": {"memory": "32Gi"},
    }
    (mount,) = container["volumeMounts"]
    (volume,) = objects["Deployment/llmrpc"]["spec"]["template"]["spec"]["volumes"]
    assert (mount["name"], mount["mountPath"]) == (volume["name"], "/w")
    assert volume["persistentVolumeClaim"]["claimName"] == "weights"


def test_no_gpu_is_requested_for_an_engine_that_runs_on_the_cpu():
    with pytest.raises(SystemExit) as exit_:
        manifests("--gpus", "1")
    assert exit_.value.code == 2


def test_defaults_set_no_resources_and_no_namespace():
    objects = manifests()
    assert all("namespace" not in o["metadata"] for o in objects.values())
    assert "resources" not in _container(objects)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--name", "Bad_Name"], "--name 'Bad_Name'"),
        (["--health-port", "50051"], "must differ"),
        (["--http-port", "70000"], "must be 1 to 65535"),
        (["--drain-delay", "1"], "--drain-delay must be at least"),
        (["--replicas", "-1"], "--replicas"),
    ],
)
def test_bad_values_are_refused_by_flag(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        manifests(*args)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_image_defaults_to_the_repositorys_build_and_can_be_replaced(capsys):
    assert k8s_cli.main([]) == 0  # works as typed
    (deployment, *_) = yaml.safe_load_all(capsys.readouterr().out)
    assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == "llmrpc:0.1.0"
    assert _container(manifests())["image"] == IMAGE
