"""``llmrpc serve --help``: the flags that work by group, refused and inert flags in brief at the
end; ``--help=all``, ``--help=GROUP``, ``--help=WORD``, ``--help=listgroup`` as vLLM's."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from llmrpc.common.args import OneLineErrorParser
from llmrpc.server import options, serve_help
from llmrpc.server.flag_table import FLAGS
from llmrpc.server.flags import State

WORKS = [flag for flag in FLAGS if flag.state is State.WORKS]
NOT_WORKING = [flag for flag in FLAGS if flag.state is not State.WORKS]
LLMRPC = Path(sys.executable).with_name("llmrpc")  # the installed console script


@pytest.fixture(autouse=True)
def _fixed_width(monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")


def serve_help_text(capsys, *argv: str) -> str:
    parser = OneLineErrorParser(prog="llmrpc serve", add_help=False)
    options.add_serve_arguments(parser)
    with pytest.raises(SystemExit) as exit_info:
        options.parse_serve_values(parser, list(argv))
    assert exit_info.value.code in (0, None)
    return capsys.readouterr().out


def option_lines(text: str) -> list[str]:
    """The first name on each flag line of an argparse listing (--help's own line left out)."""
    return [name for name in re.findall(r"^  (-[\w-]+)", text, re.MULTILINE) if name != "-h"]


def named(flag_name: str, text: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(flag_name)}(?![\w-])", text) is not None


def test_plain_help_lists_the_working_flags_then_the_others_in_brief(capsys):
    text = serve_help_text(capsys, "--help")
    listing, _, brief = text.partition("\nRefused flags:")
    assert brief, "no brief section of refused flags"
    assert option_lines(listing) == [flag.name for flag in WORKS]
    assert "[refused]" not in text and "[inert]" not in text
    _, _, inert = brief.partition("\nInert flags:")
    assert inert, "no brief section of inert flags"
    for flag in NOT_WORKING:
        assert named(flag.name, inert if flag.state is State.INERT else brief), flag.name
    one_line = " ".join(brief.split())
    for reason in {flag.help for flag in NOT_WORKING}:  # each reason once, before its flags
        assert one_line.count(f": {reason}.") == 1, reason


def test_plain_help_is_well_below_the_full_listing(capsys):
    plain = serve_help_text(capsys, "--help").count("\n")
    full = serve_help_text(capsys, "--help=all").count("\n")
    # 0.59 until -O and --enforce-eager became working flags (shown in full here), 0.60 since;
    # 0.65 since the ten flags of tool calling, reasoning and structured output work; 0.68
    # since the pooling flags and the two tracing flags work; 0.72 since the LoRA flags work;
    # 0.75 since the tensor-parallel flags work; 0.76 since the structured-output flags of our
    # own; 0.77 since the bounds on one request's prompts and sequences; 0.78 since
    # --speculative-config's draft models (and --help's line for --help=models)
    assert plain < 0.78 * full
    assert serve_help_text(capsys, "-h") == serve_help_text(capsys, "--help")


def test_help_all_shows_every_flag_in_full_with_its_state(capsys):
    text = serve_help_text(capsys, "--help=all")
    assert option_lines(text) == [flag.name for flag in FLAGS]
    # Each tag once per flag in its state, and once more where the closing lines explain it.
    assert text.count("[refused]") == sum(flag.state is State.REFUSED for flag in FLAGS) + 1
    assert text.count("[inert]") == sum(flag.state is State.INERT for flag in FLAGS) + 1
    assert text.count("(llmrpc)") == sum(flag.ours for flag in FLAGS) + 1
    assert serve_help_text(capsys, "--help", "all") == text


@pytest.mark.parametrize("topic", ["model", "ModelConfig", "modelconfig"])
def test_help_group_shows_that_group_by_our_name_or_vllms(capsys, topic):
    text = serve_help_text(capsys, f"--help={topic}")
    assert option_lines(text) == [flag.name for flag in FLAGS if flag.group == "model"]


def test_help_word_shows_the_flag_it_names_else_those_whose_names_contain_it(capsys):
    text = serve_help_text(capsys, "--help=max-num")
    expected = [flag.name for flag in FLAGS if any("max-num" in name for name in flag.names)]
    assert option_lines(text) == expected and len(expected) > 2
    for topic in ("max-num-seqs", "--max-num-seqs", "MAX-NUM-SEQS"):
        assert option_lines(serve_help_text(capsys, f"--help={topic}")) == ["--max-num-seqs"]
    assert option_lines(serve_help_text(capsys, "--help=-tp")) == ["--tensor-parallel-size"]


def test_help_listgroup_names_every_group(capsys):
    text = serve_help_text(capsys, "--help=listgroup")
    for heading, names in serve_help.GROUP_TOPICS.items():
        assert heading in text and names[0] in text


def test_every_group_has_a_help_topic():
    assert {flag.group for flag in FLAGS} == set(serve_help.GROUP_TOPICS)


def test_an_unknown_topic_is_one_line(capsys):
    parser = OneLineErrorParser(prog="llmrpc serve", add_help=False)
    options.add_serve_arguments(parser)
    with pytest.raises(SystemExit) as exit_info:
        options.parse_serve_values(parser, ["--help=zzzz"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (
        "llmrpc serve: error: --help=zzzz: no group or flag name matches; --help=listgroup "
        "lists the groups\n"
    )


def run_llmrpc(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(LLMRPC), *argv], capture_output=True, text=True, timeout=120, check=False
    )


def test_the_installed_command_prints_help_and_names_a_mistyped_flag():
    shown = run_llmrpc("serve", "--help")
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith("usage: llmrpc serve [MODEL] [flags]")
    assert "\nRefused flags:" in shown.stdout and "\nInert flags:" in shown.stdout
    mistyped = run_llmrpc("serve", "--max-model-lenn", "4k")
    assert mistyped.returncode == 2
    assert mistyped.stderr == (
        "llmrpc serve: error: unrecognized argument --max-model-lenn; did you mean "
        "--max-model-len?\n"
    )


def test_help_models_lists_what_the_engine_does_with_each_architecture(capsys):
    """The table against the engine's own dispatch (``model_class``), architecture by
    architecture: a config of each causal-LM type Transformers has, named as the table names it,
    is served natively, through Transformers, or refused, as the section it is listed in says."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from llmrpc.engine.models import NATIVE_MODELS, model_class
    from llmrpc.engine.models.transformers_impl import TransformersForCausalLM

    text = serve_help_text(capsys, "--help=models")
    native, through, refused = re.split(r"^(?:Through Transformers|Refused at start-up)", text,
                                        flags=re.MULTILINE)  # fmt: skip

    def names(part: str, columns: bool) -> set[str]:  # the indented lines' names
        rows = re.findall(r"^  (\w.*)$", part, re.MULTILINE)
        return {name for row in rows for name in (row.split() if columns else row.split()[:1])}

    listed = {"native": names(native, columns=False), "through": names(through, columns=True),
              "refused": names(refused, columns=True)}  # fmt: skip
    assert listed["native"] == set(NATIVE_MODELS)
    assert {"GPT2LMHeadModel", "OPTForCausalLM"} <= listed["through"]
    assert "BloomForCausalLM" in listed["refused"]
    checked = 0
    for model_type, name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        try:
            config = AutoConfig.for_model(model_type)
        except Exception:  # noqa: BLE001, S112 - a type whose config needs arguments
            continue
        config.architectures = [name]
        checked += 1
        try:
            served = model_class(config)
        except ValueError:
            assert name in listed["refused"], name
            continue
        if served is TransformersForCausalLM:
            assert name in listed["through"], name
        else:
            assert name in listed["native"], name
    assert checked > 150
