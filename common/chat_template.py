"""``--chat-template``: a file's path, or the template text itself (vLLM's rule)."""

from __future__ import annotations

# A value holding one of these cannot be meant as a path: it is the template itself.
TEMPLATE_CHARACTERS = ("{", "}", "\n")


def read_chat_template(value: str) -> str:
    """The template ``--chat-template value`` names.

    As in vLLM, the value is a file path if such a file can be read; otherwise, if it holds a
    brace or a line break, it is the template text; otherwise it was meant as a path and
    ValueError names the flag and the reason the file could not be read.
    """
    try:
        with open(value, encoding="utf-8") as file:
            return file.read()
    except OSError as error:
        if any(character in value for character in TEMPLATE_CHARACTERS):
            return value
        reason = error.strerror or str(error)
        raise ValueError(f"--chat-template {value}: cannot read this file: {reason}") from None
    except UnicodeDecodeError as error:
        raise ValueError(f"--chat-template {value}: not a UTF-8 text file: {error}") from None
