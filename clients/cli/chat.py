"""``llmrpc chat``: an interactive conversation, streamed, with the history kept.

Each line read from stdin is a user turn; the reply streams to stdout and joins the history.
With a terminal on stdin a "> " prompt is shown and Ctrl-C stops a reply (the session goes on);
piped input gives clean output for scripts. ``/reset`` forgets the history, ``/exit`` (or end of
input) ends the session.
"""

from __future__ import annotations

import signal
import sys

from llmrpc.clients.cli import common
from llmrpc.clients.errors import LlmrpcError

RESET_COMMAND = "/reset"
EXIT_COMMAND = "/exit"
# Most tokens in a reply unless --max-tokens says otherwise: more than an answer needs, few enough
# that a small model caught repeating itself stops within seconds, not at its context's end.
DEFAULT_MAX_TOKENS = 1024


def build_parser() -> common.Parser:
    parser = common.Parser(
        prog="llmrpc chat",
        description=f"""\
Chat with the served model: one line per user turn, replies streamed.
{RESET_COMMAND} forgets the history; {EXIT_COMMAND} or end of input quits.

Each reply runs until the model stops, at most {DEFAULT_MAX_TOKENS} tokens or what the context
window leaves (--max-tokens N changes that); at a terminal, Ctrl-C stops a
reply and the chat goes on. Sampling follows the server's defaults unless flags
set it, e.g.
llmrpc chat --temperature 0.2 --top-p 0.9 --max-tokens 512""",
    )
    parser.add_argument("--system", help="System message that opens the conversation.")
    common.add_sampling_arguments(
        parser,
        f"Most tokens in each reply. Default: until the model stops, at most "
        f"{DEFAULT_MAX_TOKENS} tokens, or fewer when the conversation so far leaves less room in "
        "the context window.",
    )
    common.add_connection_arguments(parser)
    return parser


class Conversation:
    def __init__(self, system: str | None) -> None:
        self.system = system
        self.messages: list[dict[str, str]] = []
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []


def read_turns(interactive: bool):
    """User lines from stdin, blank ones skipped, until end of input or /exit."""
    while True:
        if interactive:
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line or line.strip() == EXIT_COMMAND:
            return
        if line.strip():
            yield line.strip()


def reply(
    client, conversation: Conversation, user_text: str, params: dict, interactive: bool
) -> None:
    """Stream the answer to one user turn; the turn joins the history once answered, or as far
    as it got when Ctrl-C stopped it at a terminal."""
    messages = [*conversation.messages, {"role": "user", "content": user_text}]
    if "max_tokens" not in params:
        tokens = client.tokenize(messages=messages)
        max_tokens = common.max_tokens_within_context(
            tokens.count, tokens.max_model_len, DEFAULT_MAX_TOKENS
        )
        params = {**params, "max_tokens": max_tokens}
    parts = []
    stream = client.chat_stream(messages, **params)
    interrupted = False

    def stop(signum, frame) -> None:
        # Ctrl-C cancels the call rather than raising KeyboardInterrupt wherever the loop is:
        # raised inside gRPC's wait for the next message, it can leave gRPC's lock released
        # twice ("cannot release un-acquired lock") and the chat ends with a traceback.
        nonlocal interrupted
        interrupted = True
        stream.cancel()

    previous = signal.signal(signal.SIGINT, stop) if interactive else None
    try:
        for delta in stream:
            print(delta.text, end="", flush=True)
            parts.append(delta.text)
    except LlmrpcError:
        if not interrupted:  # a cancellation we asked for ends the reply; anything else is news
            raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
        stream.close()  # cancels the call if it is still open: the server aborts the request
    print(flush=True)
    conversation.messages = [*messages, {"role": "assistant", "content": "".join(parts)}]


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    params = common.sampling_params(args)

    def command() -> None:
        conversation = Conversation(args.system)
        with common.client_from_args(args, args.model) as client:
            interactive = sys.stdin.isatty()
            for user_text in read_turns(interactive):
                if user_text == RESET_COMMAND:
                    conversation.reset()
                else:
                    reply(client, conversation, user_text, params, interactive)

    return common.run_command(command)
