"""The parser every ``rlt-hal`` command shares: one-line errors and every default in the help.

argparse prints the whole usage block (20 lines for ``generate``) above a mistyped value; here
an error is one line that names the flag and where to read more. Its subcommands are parsers
of the same class, so every command gets both, and the text a command is listed with in
``rlt-hal --help`` heads its own ``--help``.
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Sequence
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

    def parse_known_args(  # type: ignore[override]  # typeshed's overloads, one behaviour
        self, args: Sequence[str] | None = None, namespace: Any = None
    ) -> Any:
        """An option this command does not know is reported as unknown (with the one it likely
        meant) before a required option it makes look missing: ``--promt`` is not a missing
        ``--prompt``."""
        if args is not None and not any(
            isinstance(a, argparse._SubParsersAction) for a in self._actions
        ):
            self._check_unknown(list(args))
        return super().parse_known_args(args, namespace)

    def _check_unknown(self, args: list[str]) -> None:
        known = list(self._option_string_actions)
        for token in args:
            if token == "--":
                return
            name = token.split("=", 1)[0]
            if not name.startswith("--") or name in known:
                continue
            if any(o.startswith(name) for o in known if o.startswith("--")):
                continue  # an abbreviation argparse resolves (or calls ambiguous)
            close = difflib.get_close_matches(name, [o for o in known if o.startswith("--")], 1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            self.error(f"unrecognized argument {name}{hint}")

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")
