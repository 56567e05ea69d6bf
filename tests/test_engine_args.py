"""One EngineArgs: every engine option is declared once and reaches every entry point."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import attrs
import pytest

from runtime_glue.cli.main import build_parser
from runtime_glue.engine.args import EngineArgs
from runtime_glue.server.args import ServerArgs, as_options, split_options

ROOT = Path(__file__).resolve().parents[1]
FIELDS = [f.name for f in attrs.fields(EngineArgs)]


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _subparser(*path: str) -> argparse.ArgumentParser:
    parser = build_parser()
    for name in path:
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = action.choices[name]
    return parser


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings}


@pytest.mark.parametrize("command", ["generate", "serve", "run", "plan", "parity"])
def test_every_engine_option_reaches_the_engine_commands(command):
    assert {_flag(n) for n in FIELDS} <= _flags(_subparser(command))


@pytest.mark.parametrize(
    "bench",
    [
        "latency",
        "baseline",
        "plans",
        "adaptive",
        "determinism",
        "graphs",
        "speculative",
        "structured",
    ],
)
def test_bench_commands_take_the_engine_options_they_do_not_size_themselves(bench):
    from runtime_glue.bench.cli import SET_BY_BENCH

    flags = _flags(_subparser("bench", bench))
    assert {_flag(n) for n in FIELDS if n not in SET_BY_BENCH} <= flags
    assert not {_flag(n) for n in SET_BY_BENCH} & flags


def test_parsed_options_give_the_declared_defaults_and_the_given_values():
    args = _subparser("serve").parse_args(["--block-size", "32", "--no-deterministic"])
    engine = EngineArgs.from_cli_args(args)
    assert engine == EngineArgs(block_size=32, deterministic=False)
    assert ServerArgs.from_cli_args(args) == ServerArgs()
    assert split_options(as_options(engine, ServerArgs(port=9))) == (engine, ServerArgs(port=9))


def test_mutually_exclusive_options_are_refused_together(capsys):
    with pytest.raises(SystemExit):
        _subparser("generate").parse_args(
            ["--prompt", "x", "--num-blocks", "4", "--kv-cache-memory", "9"]
        )
    assert "not allowed with argument" in capsys.readouterr().err


def test_an_unknown_option_is_an_error_everywhere(tiny_ckpt):
    from runtime_glue.engine.llm import LLM

    with pytest.raises(TypeError, match="block_sise"):
        LLM(tiny_ckpt, block_sise=16)
    with pytest.raises(ValueError, match="unknown rlt-hal serve option.*block_sise"):
        split_options({"block_sise": 16})


def test_no_engine_option_is_declared_outside_engine_args():
    """A second ``add_argument("--block-size", ...)`` anywhere would be a second declaration
    (and a second default) of an engine option."""
    declared = re.compile(r"add_argument\(\s*\"(--[a-z-]+)\"")
    engine_flags = {_flag(n) for n in FIELDS}
    # The same words, other options: which checkpoint to write, and the name an HTTP client asks
    # a running server for.
    other_meanings = {
        ("runtime_glue/cli/main.py", "--preset"),
        ("runtime_glue/bench/cli.py", "--model"),
    }
    found = {
        (str(path.relative_to(ROOT)), flag)
        for path in (ROOT / "runtime_glue").rglob("*.py")
        for flag in declared.findall(path.read_text())
        if flag in engine_flags
    }
    assert found == other_meanings


def test_the_server_layer_never_imports_the_command_line():
    offenders = [
        str(path.relative_to(ROOT))
        for path in (ROOT / "runtime_glue" / "server").rglob("*.py")
        if re.search(r"^\s*(from|import) runtime_glue\.cli\b", path.read_text(), re.M)
    ]
    assert offenders == []
