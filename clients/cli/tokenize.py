"""``llmrpc tokenize TEXT``: the server's token ids for a text, as JSON."""

from __future__ import annotations

import sys

from llmrpc.clients.cli import common


def build_parser() -> common.Parser:
    parser = common.Parser(
        prog="llmrpc tokenize",
        description="Tokenize text with the served model's tokenizer and print JSON: "
        '{"token_ids": [...], "token_strings": [...], "count": N, "max_model_len": N}.',
    )
    parser.add_argument("text", help='Text to tokenize; "-" reads it from stdin.')
    parser.add_argument("--model", default="", help="Served model name (default: the server's).")
    parser.add_argument(
        "--no-special-tokens",
        action="store_false",
        dest="add_special_tokens",
        default=None,
        help="Do not let the tokenizer add special tokens (e.g. BOS).",
    )
    common.add_connection_arguments(parser)
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    text = sys.stdin.read() if args.text == "-" else args.text

    def command() -> None:
        with common.client_from_args(args, args.model) as client:
            tokens = client.tokenize(text, add_special_tokens=args.add_special_tokens)
        common.print_json(tokens)

    return common.run_command(command)
