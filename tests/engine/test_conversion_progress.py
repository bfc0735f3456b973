"""A GGUF conversion's progress where stderr is a log file, not a terminal: plain lines, never
tqdm's carriage returns or the cursor-up codes (``ESC[A``) of Transformers' nested bars. The
conversion's Transformers calls are stand-ins here that draw bars as Transformers' own do (its
GGUF tensors with ``tqdm.auto``, its weight loading with ``transformers.utils.logging.tqdm``)."""

from __future__ import annotations

import io
import logging
import sys
from pathlib import Path
from types import SimpleNamespace

from transformers import modeling_gguf_pytorch_utils
from transformers.utils import logging as hf_logging

from llmrpc.engine.loading import loader


class _Saved:
    def save_pretrained(self, out_dir, **_):
        Path(out_dir, f"{type(self).__name__}.saved").write_text("x")


class _Tokenizer(_Saved):
    chat_template = "{{ messages }}"

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        return cls()


class _Model(_Saved):
    config = SimpleNamespace(max_position_embeddings=2048)

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        for _ in modeling_gguf_pytorch_utils.tqdm(range(3), desc="Converting GGUF tensors"):
            pass
        for _ in hf_logging.tqdm(range(3), desc="Loading weights"):
            pass
        return cls()


def test_conversion_progress_in_a_log_is_plain_lines(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(loader, "AutoTokenizer", _Tokenizer)
    monkeypatch.setattr(loader, "_causal_lm_class", lambda: _Model)
    log = io.StringIO()  # not a TTY, as stderr redirected to a file
    monkeypatch.setattr(sys, "stderr", log)
    with caplog.at_level(logging.INFO, logger="llmrpc.engine.loading.loader"):
        loader.convert_gguf(tmp_path / "model.gguf", tmp_path)
    assert "\x1b[" not in log.getvalue() and "\r" not in log.getvalue(), repr(log.getvalue())
    lines = [record.getMessage() for record in caplog.records]
    assert any("dequantize" in line and "model.gguf" in line for line in lines), lines
    assert lines[-1].startswith("converted model.gguf in "), lines
    assert hf_logging.is_progress_bar_enabled()  # Transformers' bars are back on afterwards
