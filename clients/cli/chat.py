"""``llmrpc chat``: an interactive conversation, streamed, with the history kept.

Each line read from stdin is a user turn; the reply streams to stdout and joins the history.
With a terminal on stdin a "> " prompt is shown; piped input gives clean output for scripts.
``/reset`` forgets the history, ``/exit`` (or end of input) ends the session.
"""

from __future__ import annotations

import sys

from llmrpc.clients.cli import common

RESET_COMMAND = "/reset"
EXIT_COMMAND = "/exit"


def build_parser() -> common.Parser:
    parser = common.Parser(
        prog="llmrpc chat",
        description=f"""\
Chat with the served model: one line per user turn, replies streamed.
{RESET_COMMAND} forgets the history; {EXIT_COMMAND} or end of input quits.

Each reply runs until the model stops, bounded by the context window (--max-tokens N
caps it); sampling follows the server's defaults unless flags set it, e.g.
llmrpc chat --temperature 0.2 --top-p 0.9 --max-tokens 512""",
    )
    parser.add_argument("--system", help="System message that opens the conversation.")
    common.add_sampling_arguments(
        parser,
        "Most tokens in each reply. Default: until the model stops, bounded by the context "
        "window (what the conversation so far leaves of it).",
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


def reply(client, conversation: Conversation, user_text: str, params: dict) -> None:
    """Stream the answer to one user turn; the turn joins the history only once answered."""
    messages = [*conversation.messages, {"role": "user", "content": user_text}]
    if "max_tokens" not in params:  # until the model stops: all the room the context leaves
        tokens = client.tokenize(messages=messages)
        params = {
            **params,
            "max_tokens": common.max_tokens_within_context(tokens.count, tokens.max_model_len),
        }
    parts = []
    for delta in client.chat_stream(messages, **params):
        print(delta.text, end="", flush=True)
        parts.append(delta.text)
    print(flush=True)
    conversation.messages = [*messages, {"role": "assistant", "content": "".join(parts)}]


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    params = common.sampling_params(args)

    def command() -> None:
        conversation = Conversation(args.system)
        with common.client_from_args(args, args.model) as client:
            for user_text in read_turns(sys.stdin.isatty()):
                if user_text == RESET_COMMAND:
                    conversation.reset()
                else:
                    reply(client, conversation, user_text, params)

    return common.run_command(command)
