"""``--chat-template`` takes vLLM's rule, for ``llmrpc serve`` and ``llmrpc gateway`` alike: a
readable file's contents first; else the value itself if it holds a brace or a line break;
else an error naming the flag and why the file could not be read."""

from __future__ import annotations

import pytest

from llmrpc.common.chat_template import read_chat_template

TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}"


def test_a_file_is_read(tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    assert read_chat_template(str(path)) == TEMPLATE


def test_a_file_wins_over_reading_the_value_as_a_template(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "{{ name }}").write_text(TEMPLATE)
    assert read_chat_template("{{ name }}") == TEMPLATE


@pytest.mark.parametrize("value", [TEMPLATE, "{{ messages }}", "plain\ntext"])
def test_a_value_with_a_brace_or_a_line_break_is_the_template(value):
    assert read_chat_template(value) == value


def test_a_path_that_cannot_be_read_is_an_error_naming_the_flag(tmp_path):
    missing = tmp_path / "missing.jinja"
    with pytest.raises(ValueError) as error:
        read_chat_template(str(missing))
    assert str(error.value) == (
        f"--chat-template {missing}: cannot read this file: No such file or directory"
    )
    with pytest.raises(ValueError, match=f"--chat-template {tmp_path}: .*Is a directory"):
        read_chat_template(str(tmp_path))


def test_a_file_that_is_not_utf8_text_is_an_error(tmp_path):
    path = tmp_path / "template.bin"
    path.write_bytes(b"\xff\xfe{{")
    with pytest.raises(ValueError, match=f"--chat-template {path}: not a UTF-8 text file"):
        read_chat_template(str(path))
