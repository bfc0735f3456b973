"""The command-line client end to end: ``llmrpc generate|chat|tokenize|admin`` in subprocesses
against a running server; stdout, stderr and exit codes as a shell user relies on them."""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from client_utils import ServerThread, tiny_engine_config

from llmrpc.clients import Client
from llmrpc.clients.cli import common

LLMRPC = str(Path(sys.executable).parent / "llmrpc")
GREEDY_FLAGS = ["--temperature", "0", "--ignore-eos"]


def llmrpc(*args: str, stdin: str = "", env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [LLMRPC, *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


@pytest.fixture(scope="module")
def client(server):
    with Client(server.address) as client:
        yield client


@pytest.fixture(scope="module")
def greedy_server(tiny_llama_dir):
    """A server whose generation config makes greedy decoding its default: a client that sends
    no temperature gets the same tokens every time, one that sends temperature 1 does not."""
    config = tiny_engine_config(tiny_llama_dir)
    model = replace(config.model, override_generation_config={"temperature": 0.0})
    server = ServerThread(replace(config, model=model), host="127.0.0.1", port=0)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def long_context_greedy_server(tiny_model_factory):
    """As ``greedy_server``, with a context of 2048 tokens."""
    config = tiny_engine_config(tiny_model_factory(max_position_embeddings=2048))
    model = replace(config.model, override_generation_config={"temperature": 0.0})
    server = ServerThread(replace(config, model=model), host="127.0.0.1", port=0)
    yield server
    server.stop()


def test_generate_prints_the_output_text(server, client):
    flags = ["--max-tokens", "5", *GREEDY_FLAGS, "--url", server.address]
    result = llmrpc("generate", "Hello", *flags)
    expected = client.generate("Hello", max_tokens=5, temperature=0.0, ignore_eos=True).text
    assert (result.returncode, result.stdout, result.stderr) == (0, expected + "\n", "")
    streamed = llmrpc("generate", "Hello", "--stream", *flags)
    assert (streamed.returncode, streamed.stdout) == (0, expected + "\n")


def test_generate_json_has_ids_finish_reason_and_usage(server):
    result = llmrpc(
        "generate", "-", "--json", "--max-tokens", "4", *GREEDY_FLAGS, "--request-id", "cli-1",
        stdin="Hello", env={"LLMRPC_TARGET": server.address},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    completion = json.loads(result.stdout)
    assert completion["request_id"] == "cli-1"
    assert completion["finish_reason"] == "length"
    assert len(completion["token_ids"]) == completion["usage"]["completion_tokens"] == 4


def test_generate_stream_json_is_one_object_per_delta(server):
    result = llmrpc(
        "generate", "100 200 300", "--token-ids", "--stream", "--json", "--max-tokens", "3",
        *GREEDY_FLAGS, "--url", server.address,
    )  # fmt: skip
    deltas = [json.loads(line) for line in result.stdout.splitlines()]
    assert sum(len(d["token_ids"]) for d in deltas) == 3
    assert deltas[-1]["usage"]["prompt_tokens"] == 3


def test_generate_prints_each_of_n_samples(server, client):
    flags = ["--n", "2", "--seed", "3", "--max-tokens", "3", "--ignore-eos"]
    result = llmrpc("generate", "Hello", *flags, "--url", server.address)
    params = {"n": 2, "seed": 3, "max_tokens": 3, "ignore_eos": True}
    samples = client.generate("Hello", **params).samples
    assert (result.returncode, result.stdout) == (0, "".join(s.text + "\n" for s in samples))


def test_a_rejected_request_exits_4_with_one_line(server):
    result = llmrpc("generate", "Hi", "--top-p", "5", "--url", server.address)
    assert result.returncode == common.EXIT_REJECTED
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1
    assert "INVALID_ARGUMENT" in result.stderr and "sampling.top_p" in result.stderr
    assert "request id " in result.stderr


def test_no_server_exits_3(unused_tcp_port):
    result = llmrpc("admin", "models", "--url", f"127.0.0.1:{unused_tcp_port}", "--timeout", "2")
    assert result.returncode in (common.EXIT_UNAVAILABLE, common.EXIT_TIMEOUT)
    assert "UNAVAILABLE" in result.stderr or "DEADLINE_EXCEEDED" in result.stderr


def test_bad_flags_exit_2():
    result = llmrpc("generate", "Hi", "--max-tokens", "many")
    assert result.returncode == common.EXIT_USAGE
    assert "--max-tokens" in result.stderr


@pytest.mark.parametrize("request_ids", [[], [""], ["cli-1", "  "]])
def test_admin_abort_without_a_request_id_is_a_usage_error(request_ids):
    result = llmrpc("admin", "abort", *request_ids)
    assert (result.returncode, result.stdout) == (common.EXIT_USAGE, "")
    assert result.stderr.count("\n") == 1
    assert result.stderr.startswith("llmrpc admin abort: error: ")
    assert "REQUEST_ID" in result.stderr


def test_help_documents_the_exit_codes():
    result = llmrpc("generate", "--help")
    assert result.returncode == 0
    assert "exit codes:" in result.stdout and "UNAVAILABLE" in result.stdout


def test_chat_keeps_the_history(server, client):
    result = llmrpc(
        "chat", "--max-tokens", "3", *GREEDY_FLAGS, "--system", "Be brief.",
        "--url", server.address, stdin="Hello\n\nHow are you?\n",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    params = {"max_tokens": 3, "temperature": 0.0, "ignore_eos": True}
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    first = client.chat(history, **params).text
    history += [
        {"role": "assistant", "content": first},
        {"role": "user", "content": "How are you?"},
    ]
    second = client.chat(history, **params).text
    assert result.stdout == f"{first}\n{second}\n"


def test_chat_defaults_to_the_servers_sampling_and_answers_until_the_model_stops(greedy_server):
    result = llmrpc("chat", "--url", greedy_server.address, stdin="Hello\n")
    assert result.returncode == 0, result.stderr
    messages = [{"role": "user", "content": "Hello"}]
    with Client(greedy_server.address) as client:
        room = client.tokenize(messages=messages)
        answer = client.chat(messages, max_tokens=room.max_model_len - room.count)
    assert answer.usage.completion_tokens > 16  # the server's own default length
    assert result.stdout == answer.text + "\n"


def test_chat_replies_are_at_most_1024_tokens_by_default(long_context_greedy_server):
    address = long_context_greedy_server.address
    result = llmrpc("chat", "--url", address, stdin="Hello\n")
    assert result.returncode == 0, result.stderr
    with Client(address) as client:
        answer = client.chat([{"role": "user", "content": "Hello"}], max_tokens=1024)
    assert (answer.finish_reason.value, answer.usage.completion_tokens) == ("length", 1024)
    assert result.stdout == answer.text + "\n"


def test_ctrl_c_at_a_terminal_stops_the_reply_and_the_chat_goes_on(greedy_server):
    """Replies run until the model stops: at a terminal, Ctrl-C cuts one short (the call is
    cancelled, so the server stops computing it) and the next turn follows."""
    messages = [{"role": "user", "content": "Hello"}]
    with Client(greedy_server.address) as client:
        room = client.tokenize(messages=messages)
        full_reply = client.chat(messages, max_tokens=room.max_model_len - room.count).text
        pid, terminal = pty.fork()
        if pid == 0:  # the child: llmrpc chat on the pseudo-terminal
            # as a terminal's shell starts it: a runner that starts the tests in the background
            # ignores SIGINT, and an ignored signal stays ignored across exec
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.execv(LLMRPC, [LLMRPC, "chat", "--url", greedy_server.address])
        screen = Screen(terminal)
        screen.read_until("> ")
        os.write(terminal, b"Hello\n")
        screen.read_until("Hello\n")  # the terminal's echo; the reply follows
        screen.wait_for_output()
        os.kill(pid, signal.SIGINT)
        interrupted = screen.read_until("\n> ")
        assert len(interrupted) < len(full_reply) and full_reply.startswith(interrupted)
        deadline = time.monotonic() + 10
        while client.load().num_running_requests:
            assert time.monotonic() < deadline, "the interrupted request kept running"
            time.sleep(0.01)
    os.write(terminal, b"/exit\n")
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


class Screen:
    """What a program writes to its pseudo-terminal (line ends as "\\n"), read up to a marker."""

    def __init__(self, terminal: int) -> None:
        self.terminal = terminal
        self.pending = ""

    def wait_for_output(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.pending:
            self._read(deadline, "any output")

    def read_until(self, marker: str, timeout: float = 30.0) -> str:
        """The output before ``marker`` (consumed with it)."""
        deadline = time.monotonic() + timeout
        while marker not in self.pending:
            self._read(deadline, repr(marker))
        before, _, self.pending = self.pending.partition(marker)
        return before

    def _read(self, deadline: float, what: str) -> None:
        ready, _, _ = select.select([self.terminal], [], [], max(0.0, deadline - time.monotonic()))
        assert ready, f"no {what} on the terminal; it shows {self.pending[-300:]!r}"
        try:
            data = os.read(self.terminal, 4096).decode(errors="replace")
        except OSError:  # EIO: the program closed the terminal, it has ended
            pytest.fail(f"the program ended before {what}; it showed {self.pending!r}")
        self.pending = (self.pending + data).replace("\r\n", "\n")


def test_generate_defaults_to_the_servers_sampling_and_256_tokens(greedy_server):
    result = llmrpc("generate", "Hello", "--json", "--url", greedy_server.address)
    assert result.returncode == 0, result.stderr
    completion = json.loads(result.stdout)
    assert (completion["finish_reason"], completion["usage"]["completion_tokens"]) == (
        "length",
        256,
    )
    with Client(greedy_server.address) as client:
        assert completion["token_ids"] == client.generate("Hello", max_tokens=256).token_ids


def test_generate_default_length_stops_at_the_end_of_the_context(greedy_server):
    prompt = "word " * 400
    result = llmrpc("generate", prompt, "--json", "--url", greedy_server.address)
    assert result.returncode == 0, result.stderr
    completion = json.loads(result.stdout)
    usage = completion["usage"]
    assert completion["finish_reason"] == "length"
    assert usage["prompt_tokens"] + usage["completion_tokens"] == 512  # the tiny model's context
    ids = " ".join(map(str, range(100, 500)))
    result = llmrpc("generate", ids, "--token-ids", "--json", "--url", greedy_server.address)
    assert json.loads(result.stdout)["usage"]["completion_tokens"] == 512 - 400


def test_sampling_help_states_the_defaults_and_how_to_change_them():
    chat_help = " ".join(llmrpc("chat", "--help").stdout.split())
    assert "Default: until the model stops, at most 1024 tokens" in chat_help
    assert "--temperature 0.2" in chat_help and "`llmrpc admin info`" in chat_help
    generate_help = " ".join(llmrpc("generate", "--help").stdout.split())
    assert "Default: 256, or fewer when the prompt leaves less room" in generate_help
    assert "--temperature 0.8 --max-tokens 512" in generate_help


def test_tokenize_prints_ids_and_strings(server, client):
    result = llmrpc("tokenize", "Hello world", "--target", server.address)
    assert result.returncode == 0, result.stderr
    tokens = json.loads(result.stdout)
    assert tokens["token_ids"] == client.tokenize("Hello world").token_ids
    assert tokens["token_strings"] == ["Hello", "Ġworld"]
    assert tokens["count"] == 2


def test_admin_verbs(server, client):
    env = {"LLMRPC_TARGET": server.address}
    info = json.loads(llmrpc("admin", "info", env=env).stdout)
    assert info["server"]["api_version"] == "v1"
    assert info["model"]["model"] == client.model_info().model
    models = json.loads(llmrpc("admin", "models", env=env).stdout)
    assert [m["id"] for m in models] == [m.id for m in client.models()]
    load = json.loads(llmrpc("admin", "load", env=env).stdout)
    assert load["num_running_requests"] == 0 and load["num_kv_blocks"] == 256
    abort = llmrpc("admin", "abort", "no-such-request", env=env)
    assert json.loads(abort.stdout) == {"aborted_request_ids": []}
    reset = llmrpc("admin", "reset-prefix-cache", env=env)
    assert (reset.returncode, json.loads(reset.stdout)) == (0, {"prefix_cache_reset": True})
    health = llmrpc("admin", "health", env=env)
    assert (health.returncode, health.stdout) == (0, "SERVING\n")


@pytest.mark.parametrize("verb", ["sleep", "wake"])
def test_admin_sleep_and_wake_without_sleep_mode_are_rejected(server, verb):
    result = llmrpc("admin", verb, "--url", server.address)
    assert (result.returncode, result.stdout) == (common.EXIT_REJECTED, "")
    assert result.stderr.count("\n") == 1
    assert result.stderr.startswith(
        "llmrpc: error: FAILED_PRECONDITION: "
        "sleep mode is off; start the server with --enable-sleep-mode (request id "
    )
