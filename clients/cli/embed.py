"""``llmrpc embed TEXT [TEXT...]``: the server's embeddings of texts, one JSON line each."""

from __future__ import annotations

import sys

from llmrpc.clients.cli import common


def build_parser() -> common.Parser:
    parser = common.Parser(
        prog="llmrpc embed",
        description="Embed texts with the served model and print one JSON line per text: "
        '{"index": I, "embedding": [...], "num_prompt_tokens": N}, or {"index": I, "error": '
        '"CODE: message"} for a text that could not be embedded (exit status 1).',
    )
    parser.add_argument(
        "texts", nargs="+", help='Texts to embed; "-" reads one per line from stdin.'
    )
    parser.add_argument("--model", default="", help="Served model name (default: the server's).")
    parser.add_argument(
        "--dimensions", type=int, default=None, help="Keep the first N values (Matryoshka)."
    )
    parser.add_argument(
        "--no-normalize",
        action="store_false",
        dest="normalize",
        default=None,
        help="Do not L2-normalize the vectors (default: the model's).",
    )
    common.add_connection_arguments(parser)
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    texts = sys.stdin.read().splitlines() if args.texts == ["-"] else args.texts

    def command() -> int:
        with common.client_from_args(args, args.model) as client:
            answer = client.embed(texts, dimensions=args.dimensions, normalize=args.normalize)
        for result in answer.results:
            if result.error is not None:
                common.print_json({"index": result.index, "error": str(result.error)})
            else:
                line = {"index": result.index, "embedding": result.embedding}
                common.print_json({**line, "num_prompt_tokens": result.num_prompt_tokens})
        return int(any(result.error is not None for result in answer.results))

    return common.run_command(command)
