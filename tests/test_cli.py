"""The rlt-hal command line, run as a user would run it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from runtime_glue.engine.llm import LLM
from runtime_glue.engine.sampling import SamplingParams
from tests.helpers import rlt_hal


def test_toy_checkpoint_writes_the_hf_layout_with_a_chatml_tokenizer(tmp_path):
    proc = rlt_hal("toy-checkpoint", str(tmp_path / "m"), "--preset", "tiny", "--seed", "3")
    assert proc.returncode == 0, proc.stderr
    names = {p.name for p in (tmp_path / "m").iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["model_type"] == "ouro" and cfg["total_ut_steps"] == 4
    llm = LLM(tmp_path / "m", block_size=16, num_blocks=4)
    text = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert llm.tokenizer.convert_tokens_to_ids("<|im_end|>") == 2


def test_a_checkpoint_is_never_written_over_another_or_beside_other_files_unless_forced(
    tmp_path, capsys
):
    """toy-checkpoint and quantize into a directory that is not empty: a one-line error, exit
    2, nothing touched; with --force, written."""
    from runtime_glue.cli.main import main

    target = tmp_path / "mine"
    target.mkdir()
    (target / "config.json").write_text('{"precious": true}')
    (target / "notes.txt").write_text("keep")
    assert main(["toy-checkpoint", str(target)]) == 2
    err = capsys.readouterr().err.strip()
    assert "exists and is not empty (config.json, notes.txt)" in err and "--force" in err
    assert "\n" not in err
    assert json.loads((target / "config.json").read_text()) == {"precious": True}
    assert sorted(p.name for p in target.iterdir()) == ["config.json", "notes.txt"]
    src = tmp_path / "src"
    assert main(["toy-checkpoint", str(src)]) == 0
    assert main(["quantize", str(src), str(target), "--scheme", "w8a16"]) == 2
    assert "rlt-hal quantize writes a new directory" in capsys.readouterr().err
    assert main(["toy-checkpoint", str(target), "--force"]) == 0
    assert json.loads((target / "config.json").read_text())["model_type"] == "ouro"
    assert (target / "notes.txt").read_text() == "keep"
    assert main(["toy-checkpoint", str(tmp_path / "new" / "dir")]) == 0  # created
    (tmp_path / "file").write_text("x")
    assert main(["toy-checkpoint", str(tmp_path / "file")]) == 2
    assert "exists and is not a directory" in capsys.readouterr().err


def test_bench_serve_without_a_server_or_a_scheme_is_one_line_and_exits_non_zero(
    free_tcp_port, capsys
):
    from runtime_glue.cli.main import main

    base = ["bench", "serve", "--num-requests", "1", "--url"]
    assert main([*base, f"http://127.0.0.1:{free_tcp_port}/v1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rlt-hal: error: --url http://127.0.0.1:")
    assert "no OpenAI-compatible server answers there (ConnectError" in err and "\n" not in err
    assert main([*base, f"127.0.0.1:{free_tcp_port}/v1"]) == 2
    assert "has no scheme: give it as http://HOST:PORT/v1" in capsys.readouterr().err


def test_generate_json_reports_the_same_tokens_as_the_python_api(tiny_ckpt):
    proc = rlt_hal(
        "generate",
        "--model",
        str(tiny_ckpt),
        "--prompt-ids",
        "5,6,7,8",
        "--max-tokens",
        "6",
        "--ignore-eos",
        "--block-size",
        "16",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert proc.stdout.endswith("}\n")
    want = LLM(tiny_ckpt, block_size=16, num_blocks=4).generate(
        [[5, 6, 7, 8]], SamplingParams(max_tokens=6, ignore_eos=True)
    )[0]
    assert result["token_ids"] == list(want.token_ids)
    assert result["device"] == "cpu" and result["attention_backend"] == "cpu_eager"
    assert result["finish_reason"] == "length" and result["elapsed_s"] > 0


def test_run_uses_the_embedded_random_checkpoint_and_says_so(tmp_path):
    import os

    env = {**os.environ, "RLT_HAL_CACHE": str(tmp_path)}
    proc = rlt_hal("run", "--max-tokens", "4", "--num-blocks", "8", env=env)
    assert proc.returncode == 0, proc.stderr
    assert "RANDOM weights" in proc.stderr
    assert (tmp_path / "toy-small-seed0" / "model.safetensors").is_file()


def test_bad_prompt_ids_are_a_clear_cli_error(tiny_ckpt):
    proc = rlt_hal("generate", "--model", str(tiny_ckpt), "--prompt-ids", "1,x")
    assert proc.returncode == 2
    assert "--prompt-ids must be comma-separated integers" in proc.stderr


def test_the_trained_preset_is_announced_as_trained_not_random(tiny_ckpt, monkeypatch, capsys):
    from runtime_glue.engine.args import EngineArgs
    from runtime_glue.engine.llm import build_llm
    from runtime_glue.ouro import toy

    monkeypatch.setattr(toy, "cached_checkpoint", lambda preset: tiny_ckpt)  # no training here
    build_llm(EngineArgs(preset="trained", block_size=16, num_blocks=4), announce=True)
    err = capsys.readouterr().err
    assert "RANDOM" not in err and "trained here on Python's own documentation" in err
    assert "not Ouro-1.4B" in err
    build_llm(EngineArgs(preset="small", block_size=16, num_blocks=4), announce=True)
    assert "RANDOM weights" in capsys.readouterr().err
    assert EngineArgs(model=str(tiny_ckpt)).banner() is None


def test_the_served_name_of_a_toy_checkpoint_says_which_one():
    from runtime_glue.engine.args import EngineArgs
    from runtime_glue.server.args import ServerArgs

    assert ServerArgs().model_name(EngineArgs(preset="trained")) == "rlt-hal-toy-trained"
    assert ServerArgs().model_name(EngineArgs()) == "rlt-hal-toy-random"
    assert ServerArgs().model_name(EngineArgs(model="/m")) == "/m"
    assert ServerArgs(served_model_name="x").model_name(EngineArgs(model="/m")) == "x"


HEAVY = {"torch", "transformers", "tokenizers", "safetensors", "fastapi", "numpy"}
# Runs rlt-hal's main, then prints which heavy packages it imported.
_IMPORTED_BY = f"""
import sys
from runtime_glue.cli.main import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
print(sorted({{name.split('.')[0] for name in sys.modules}} & set({sorted(HEAVY)!r})))
"""


@pytest.mark.parametrize(
    "argv", [["--help"], ["generate", "--help"], ["bench", "latency", "--help"], ["serve", "-h"]]
)
def test_help_answers_without_importing_torch(argv):
    proc = subprocess.run(
        [sys.executable, "-c", _IMPORTED_BY, *argv], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert "usage: rlt-hal" in proc.stdout
    assert proc.stdout.splitlines()[-1] == "[]"


def test_hal_exports_every_name_it_lists():
    import hal

    assert set(hal.__all__) == set(hal._EXPORTS)
    for name in hal.__all__:
        assert getattr(hal, name) is not None


def _every_option():
    """(command, action) for every option of every command and bench kind."""
    import argparse

    from runtime_glue.cli.main import build_parser

    def walk(parser, path):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield from walk(sub, [*path, name])
            elif action.dest != "help":
                yield " ".join(path), action

    return list(walk(build_parser(), []))


def test_every_option_has_help_and_shows_its_default():
    from runtime_glue.cli.parser import HelpFormatter

    formatter = HelpFormatter("rlt-hal")
    missing = [f"{c} {a.option_strings or a.dest}" for c, a in _every_option() if not a.help]
    assert missing == []
    for command, action in _every_option():
        if action.option_strings and action.default not in (None, False):
            assert "default" in formatter._get_help_string(action), (command, action.dest)


def test_a_bad_value_is_a_one_line_error_naming_the_flag():
    proc = rlt_hal("generate", "--prompt", "hi", "--block-size", "abc")
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "rlt-hal generate: error: argument --block-size: invalid int value: 'abc' "
        "(see rlt-hal generate --help)"
    ]


LOADED = ("loading weights", "KV pool")  # what a start-up prints once the model has loaded


@pytest.mark.parametrize(
    "prompt, error",
    [
        (["--prompt", ""], "--prompt is empty: give some text (or --prompt-ids)"),
        (["--prompt-ids", ","], "--prompt-ids is empty: give at least one token id"),
    ],
    ids=["text", "ids"],
)
def test_an_empty_prompt_is_refused_before_the_model_loads(tiny_ckpt, prompt, error):
    proc = rlt_hal("generate", "--model", str(tiny_ckpt), *prompt)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [f"rlt-hal: error: {error}"]
    assert not any(word in proc.stderr for word in LOADED)


def test_a_port_in_use_is_reported_before_the_model_loads(tiny_ckpt):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = rlt_hal("serve", "--model", str(tiny_ckpt), "--port", str(port))
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        f"rlt-hal: error: --port {port}: 127.0.0.1:{port} is already in use (another "
        "server?); stop it or choose another --port"
    ]
    assert not any(word in proc.stderr for word in LOADED)


def test_a_mistyped_option_is_unknown_not_a_missing_required_one(capsys):
    from runtime_glue.cli.main import main

    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--promt", "hi"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "rlt-hal generate: error: unrecognized argument --promt (did you mean --prompt?) "
        "(see rlt-hal generate --help)"
    )
    with pytest.raises(SystemExit):
        main(["serve", "--max-model-lenght", "64"])
    assert "unrecognized argument --max-model-lenght (did you mean --max-model-len?)" in (
        capsys.readouterr().err
    )


def test_plan_prints_its_plan_once(tiny_ckpt):
    proc = rlt_hal("plan", "--model", str(tiny_ckpt), "--block-size", "16", "--num-blocks", "8")
    assert proc.returncode == 0, proc.stderr
    both = proc.stdout + proc.stderr
    assert both.count("deterministic mode, cpu_eager attention") == 1
    assert proc.stdout.startswith("cpu: deterministic mode") and "| op | rows of |" in proc.stdout
