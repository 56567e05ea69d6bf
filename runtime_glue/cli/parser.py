"""The parser every ``rlt-hal`` command shares: one-line errors and every default in the help.

argparse prints the whole usage block (20 lines for ``generate``) above a mistyped value; here
an error is one line that names the flag and where to read more. Its subcommands are parsers
of the same class, so every command gets both, and the text a command is listed with in
``rlt-hal --help`` heads its own ``--help``.
"""

from __future__ import annotations

import argparse
from typing import Any, NoReturn


class HelpFormatter(argparse.HelpFormatter):
    """Appends ``(default: X)`` to an option's help unless the help names its default already
    or there is none to name (None, or off for a switch)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            not action.option_strings
            or "default" in text
            or default is None
            or default is False
            or default is argparse.SUPPRESS
        ):
            return text
        if isinstance(default, list | tuple):
            shown = ",".join(str(v) for v in default)
        else:
            shown = str(default).encode("unicode_escape").decode()  # a newline shows as \n
        return f"{text} (default: {shown.replace('%', '%%')})"


class _Commands(argparse._SubParsersAction):
    """Subcommands whose ``--help`` starts with the line ``rlt-hal --help`` lists them with."""

    def add_parser(self, name: str, **kwargs: Any) -> argparse.ArgumentParser:
        if "help" in kwargs:
            kwargs.setdefault("description", kwargs["help"])
        return super().add_parser(name, **kwargs)


class Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
        self.register("action", "parsers", _Commands)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")
