"""The prompt options the generating commands share: text, or token ids."""

from __future__ import annotations

import argparse


def add_prompt_args(
    parser: argparse.ArgumentParser, required: bool = False, default: str | None = None
) -> None:
    src = parser.add_mutually_exclusive_group(required=required)
    src.add_argument("--prompt", default=default, help="the prompt's text")
    src.add_argument(
        "--prompt-ids", help="the prompt as comma-separated token ids, instead of --prompt"
    )


def prompt_of_args(args: argparse.Namespace) -> list[int] | str:
    if args.prompt_ids is not None:
        try:
            return [int(t) for t in args.prompt_ids.split(",") if t.strip()]
        except ValueError:
            raise ValueError(
                f"--prompt-ids must be comma-separated integers, got {args.prompt_ids!r}"
            ) from None
    return args.prompt
