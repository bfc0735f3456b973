"""A text prompt that cannot fit the context is refused by its length in characters, before
it is tokenized.

Tokenizing costs time and memory per token (the fast tokenizer's encoding keeps ids, offsets,
token strings and masks; the ids become a Python list): a 10 MB prompt cost the server 10 s
and, on a worker thread's malloc arena that kept it, hundreds of MB before its refusal as too
long. No token of the vocabulary stands for more characters than its own string has (a
byte-level BPE token's string has a symbol per byte; a special token is its text), so a text
longer than ``max_model_len`` times the longest token's string has more tokens than the
context, whatever it says. Tokenizers whose normalizer deletes characters (BERT's drops
control characters) could make fewer tokens of such a text; a prompt made mostly of what
would be deleted is refused all the same. With ``truncate_prompt_tokens`` the text is
tokenized whole, then cut, as before.
"""

from __future__ import annotations

import threading
import weakref

from llmrpc.server.errors import InvalidArgument

_lock = threading.Lock()
_longest: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def longest_token_chars(tokenizer) -> int:
    """Characters in the longest token string of ``tokenizer``'s vocabulary, added tokens
    included (computed once per tokenizer: tens of milliseconds for 150,000 tokens)."""
    with _lock:
        found = _longest.get(tokenizer)
    if found is None:
        found = max(map(len, tokenizer.get_vocab()), default=1) or 1
        with _lock:
            _longest[tokenizer] = found
    return found


def check_can_fit(field: str, text: str, tokenizer, max_tokens: int | None) -> None:
    """INVALID_ARGUMENT naming ``field`` if ``text`` has more than ``max_tokens`` tokens
    whatever its content, told by its length alone; ``max_tokens`` None: no bound."""
    if max_tokens is None or len(text) <= max_tokens:  # a token has a character at least
        return
    bound = max_tokens * longest_token_chars(tokenizer)
    if len(text) > bound:
        raise InvalidArgument(
            field,
            f"the prompt has {len(text)} characters, more than the model's context length of "
            f"{max_tokens} tokens can hold ({bound} characters: no token of this tokenizer "
            f"is longer than {bound // max_tokens})",
        )
