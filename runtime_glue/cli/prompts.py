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
    """The prompt the options give, checked before any model loads (an empty one is an error
    here, in a second, not after loading)."""
    if args.prompt_ids is not None:
        try:
            ids = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
        except ValueError:
            raise ValueError(
                f"--prompt-ids must be comma-separated integers, got {args.prompt_ids!r}"
            ) from None
        if not ids:
            raise ValueError("--prompt-ids is empty: give at least one token id")
        return ids
    if not args.prompt:
        raise ValueError("--prompt is empty: give some text (or --prompt-ids)")
    return args.prompt
