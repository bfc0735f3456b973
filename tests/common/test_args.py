"""Every ``llmrpc`` verb answers a mistyped flag in one line naming the closest known flag (exit
2), its subcommands' flags included; the words after an unknown flag are its value, not more
unknown arguments."""

from __future__ import annotations

import pytest

from llmrpc.cli import main
from llmrpc.common.args import unrecognized

TYPOS = [
    (["serve", "--max-model-lenn", "4k"], "--max-model-lenn", "--max-model-len"),
    (["generate", "hi", "--max-tokenz", "3"], "--max-tokenz", "--max-tokens"),
    (["chat", "--temprature", "1"], "--temprature", "--temperature"),
    (["tokenize", "x", "--targt", "y"], "--targt", "--target"),
    (["admin", "info", "--targt", "x"], "--targt", "--target"),
    (["bench", "serve", "--concurrensy", "3"], "--concurrensy", "--concurrency"),
    (["bench", "throughput", "--num-promts", "3"], "--num-promts", "--num-prompts"),
    (["gateway", "--backend", "x:1", "--max-request-body-sise", "1"],
     "--max-request-body-sise", "--max-request-body-size"),
    (["envoy-config", "--backend", "x:1", "--listn", "y"], "--listn", "--listen"),
    (["k8s-manifests", "--replicaz", "2"], "--replicaz", "--replicas"),
]  # fmt: skip


@pytest.mark.parametrize(("argv", "typo", "meant"), TYPOS, ids=[a[0] for a, _, _ in TYPOS])
def test_a_mistyped_flag_names_the_closest_one(capsys, argv, typo, meant):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    # A subcommand's unknown flags are reported by its verb's parser.
    prog = "llmrpc " + " ".join(argv[:2] if argv[:2] == ["bench", "throughput"] else argv[:1])
    assert capsys.readouterr().err == (
        f"{prog}: error: unrecognized argument {typo}; did you mean {meant}?\n"
    )


def test_no_suggestion_when_nothing_is_close_and_plain_words_are_named():
    assert unrecognized(["--frobnicate", "7"], ["--port"]) == "unrecognized argument --frobnicate"
    assert unrecognized(["extra", "words"], ["--port"]) == "unrecognized arguments: extra, words"
