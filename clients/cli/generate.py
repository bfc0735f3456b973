"""``llmrpc generate PROMPT``: generate from a prompt and print the output text."""

from __future__ import annotations

import sys

from llmrpc.clients.cli import common

DEFAULT_MAX_TOKENS = 256


def build_parser() -> common.Parser:
    parser = common.Parser(
        prog="llmrpc generate",
        description=f"""\
Generate text from a prompt and print it (the prompt itself is not printed).

The output is at most {DEFAULT_MAX_TOKENS} tokens unless --max-tokens N says otherwise;
sampling follows the server's defaults unless flags set it, e.g.
llmrpc generate "Once upon a time" --temperature 0.8 --max-tokens 512""",
    )
    parser.add_argument("prompt", help='Prompt text; "-" reads it from stdin.')
    parser.add_argument("--stream", action="store_true", help="Print tokens as they arrive.")
    parser.add_argument(
        "--token-ids",
        action="store_true",
        help="PROMPT is token ids (separated by spaces or commas), used as given.",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="Print the result as JSON (ids, finish reason, usage); with --stream, one JSON "
        "object per line and delta.",
    )
    parser.add_argument("--request-id", help="Request id, for logs and `llmrpc admin abort`.")
    parser.add_argument("--n", type=int, help="Independent samples, printed one per line.")
    parser.add_argument(
        "--logprobs", type=int, help="Logprobs of each token and N alternatives (with --json)."
    )
    common.add_sampling_arguments(
        parser,
        f"Most tokens to generate. Default: {DEFAULT_MAX_TOKENS}, or fewer when the prompt "
        "leaves less room in the context window.",
    )
    common.add_connection_arguments(parser)
    return parser


def read_prompt(parser: common.Parser, text: str, token_ids: bool) -> str | list[int]:
    if text == "-":
        text = sys.stdin.read()
    if not token_ids:
        return text
    try:
        return [int(token) for token in text.replace(",", " ").split()]
    except ValueError:
        parser.error(f"--token-ids: {text!r} is not a list of integers")


def with_default_length(client, prompt: str | list[int], params: dict) -> dict:
    """``params`` with --max-tokens' default when it was not given."""
    if "max_tokens" in params:
        return params
    if isinstance(prompt, list):
        num_prompt_tokens, max_model_len = len(prompt), client.model_info().max_model_len
    else:
        tokens = client.tokenize(prompt)
        num_prompt_tokens, max_model_len = tokens.count, tokens.max_model_len
    max_tokens = common.max_tokens_within_context(
        num_prompt_tokens, max_model_len, DEFAULT_MAX_TOKENS
    )
    return {**params, "max_tokens": max_tokens}


def print_stream(deltas, as_json: bool) -> None:
    """Text as it arrives, or one JSON object per delta (JSON lines)."""
    for delta in deltas:
        if as_json:
            common.print_json(delta)
        else:
            print(delta.text, end="", flush=True)
    if not as_json:
        print()


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.stream and not args.json and (args.n or 1) > 1:
        parser.error("--stream with --n > 1 interleaves the samples: add --json")
    prompt = read_prompt(parser, args.prompt, args.token_ids)

    def command() -> None:
        with common.client_from_args(args, args.model) as client:
            params = with_default_length(client, prompt, common.sampling_params(args))
            if args.stream:
                print_stream(client.stream(prompt, request_id=args.request_id, **params), args.json)
                return
            completion = client.generate(prompt, request_id=args.request_id, **params)
            if args.json:
                common.print_json(completion, indent=2)
            else:
                for sample in completion.samples:
                    print(sample.text)

    return common.run_command(command)
