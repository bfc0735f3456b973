"""A prompt longer than the model can take is refused cleanly (INVALID_ARGUMENT, HTTP 400) and
leaves nothing alarming in the server log: no Transformers warning that "Token indices sequence
length is longer than the specified maximum sequence length ... indexing errors", which would
read as a fault although nothing was indexed. A real ``llmrpc serve``, its log read whole."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import grpc
import httpx

from llmrpc.v1 import generation_pb2, generation_pb2_grpc

# More tokens than the tokenizer's own limit (SmolLM2's tokenizer: 8192), far beyond the tiny
# model's context (512), in few enough characters to be tokenized (longer texts are refused by
# their length first: 512 tokens of at most 81 characters).
LONG_PROMPT = "a " * 10000


class ServeLog:
    """``llmrpc serve`` in a subprocess; its stderr collected line by line on a thread."""

    def __init__(self, *args: str) -> None:
        command = [sys.executable, "-m", "llmrpc.cli", "serve", *args]
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        self.process = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env
        )
        self.lines: list[str] = []
        self._pump = threading.Thread(target=self._read, daemon=True)
        self._pump.start()

    def _read(self) -> None:
        for line in self.process.stderr:
            self.lines.append(line)

    def wait_for(self, pattern: str, timeout: float = 180.0) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.process.poll() is None:
            for line in list(self.lines):
                if match := re.search(pattern, line):
                    return match
            time.sleep(0.05)
        raise AssertionError(f"no line matching {pattern!r}:\n{''.join(self.lines)[-3000:]}")

    def stop(self) -> str:
        """SIGTERM, wait, and the whole log."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=60)
        finally:
            if self.process.poll() is None:
                self.process.kill()
            self._pump.join(timeout=10)
        return "".join(self.lines)


def test_a_prompt_over_the_limit_is_refused_without_a_tokenizer_warning(tiny_llama_dir):
    serve = ServeLog(
        str(tiny_llama_dir), "--load-format", "dummy", "--host", "127.0.0.1",
        "--grpc-port", "0", "--port", "0",
    )  # fmt: skip
    try:
        grpc_port = serve.wait_for(r"serving .* on gRPC port (\d+)").group(1)
        rest_port = serve.wait_for(r"REST gateway \(http\) listening on port (\d+)").group(1)
        reply = httpx.post(
            f"http://127.0.0.1:{rest_port}/v1/completions",
            json={"prompt": LONG_PROMPT, "max_tokens": 1},
            timeout=60,
        )
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "prompt"
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            try:
                stub.Generate(generation_pb2.GenerateRequest(text=LONG_PROMPT), timeout=60)
                raise AssertionError("a prompt beyond the context was served")
            except grpc.RpcError as error:
                assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        log = serve.stop()
    assert "Token indices sequence length" not in log, log
    assert "indexing errors" not in log, log
