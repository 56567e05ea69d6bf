"""The trained preset's recipe, run tiny: a few steps on the reference manual's topics.

CI never trains the full preset (minutes); these tests train the same code path for seconds
and check what the full run relies on: the loss falls, the files load through the real loader
and tokenizer, the runtime computes what the training forward computes, the cache is reused.
"""

from __future__ import annotations

import contextlib
import io
import json
import zlib

import pytest
import torch

from runtime_glue.checks.perplexity import Scorer, fixed_and_gated, heldout_windows
from runtime_glue.engine.llm import LLM
from runtime_glue.engine.sampling import SamplingParams
from runtime_glue.engine.tokenizer import load_tokenizer
from runtime_glue.ouro import corpus, train
from runtime_glue.ouro.checkpoint import load_weights
from runtime_glue.ouro.config import OuroConfig
from runtime_glue.ouro.exits import ExitMode
from runtime_glue.ouro.progress import TrainingProgress
from runtime_glue.ouro.toy import TRAINING_FILE, cached_checkpoint, preset_config, training_summary
from tests.helpers import rlt_hal

TINY_CFG = preset_config("tiny", vocab_size=512, early_exit_threshold=0.5)
TINY_RECIPE = train.Recipe(
    steps=25, batch=8, seq_len=64, lr=3e-3, warmup=5, sources=("topics",), eval_tokens=512
)
# The runtime runs in bf16 (HF's rounding order), the training forward in fp32 on the same
# bf16 weights: logits agree to bf16's resolution at their magnitude (measured here: <= 0.01
# at |logit| ~3), and perplexities to well under 1 %.
LOGIT_TOLERANCE = 0.05
PERPLEXITY_RTOL = 0.005


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(cache, checkpoint, what the training printed on standard error)."""
    cache = tmp_path_factory.mktemp("cache")
    log = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stderr(log):
        mp.setenv("RLT_HAL_CACHE", str(cache))
        path = cached_checkpoint("trained", recipe=TINY_RECIPE, trained_cfg=TINY_CFG)
    return cache, path, log.getvalue()


def test_a_few_steps_of_the_recipe_lower_the_stage_one_loss(trained):
    record = json.loads((trained[1] / TRAINING_FILE).read_text())
    assert record["recipe_hash"] == TINY_RECIPE.digest(TINY_CFG)
    assert record["final_loss"] < record["first_loss"] - 0.3
    held = record["held_out"]
    assert (
        held["trained"]["perplexity_per_loop"][-1] < held["random_init"]["perplexity_per_loop"][-1]
    )


def test_the_checkpoint_loads_through_the_real_loader_and_generates(trained):
    path = trained[1]
    cfg = OuroConfig.from_dir(path)
    assert (cfg.total_ut_steps, cfg.early_exit_threshold) == (4, 0.5)
    llm = LLM(path, device="cpu")
    out = llm.generate(["The for statement"], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert len(out.token_ids) == 4 and all(0 <= t < cfg.vocab_size for t in out.token_ids)


def test_the_tokenizer_round_trips_held_out_text(trained):
    tok = load_tokenizer(trained[1])
    _, held = corpus.split(corpus.documents(("topics",)))
    text = held[0].text[:2000]
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    assert len(ids) < len(text.encode()) / 2  # it learned merges from this text
    assert tok.convert_ids_to_tokens([0, 1, 2]) == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def test_the_runtime_computes_what_the_training_forward_computes(trained):
    path = trained[1]
    llm = LLM(path, device="cpu")
    model = train.TrainOuro(llm.config)
    weights = load_weights(path, llm.config, llm.driver.device)
    model.load_state_dict({n: weights[n].float() for n in model.state_dict()})
    held, _ = heldout_windows(llm.tokenizer, TINY_RECIPE.sources, 64, 128)
    with torch.no_grad():
        logits, _ = model(held[:1, :-1])
    runtime, _ = Scorer(llm).prefill(held[0, :-1].tolist(), ExitMode(step=3))
    assert (runtime - logits[-1, 0]).abs().max() <= LOGIT_TOLERANCE
    mine = train.loop_losses(model, held)["perplexity_per_loop"]
    theirs = fixed_and_gated(Scorer(llm), held, None)["modes"]
    for t in range(4):
        assert theirs[f"loop {t}"]["perplexity"] == pytest.approx(mine[t], rel=PERPLEXITY_RTOL)


def test_the_cache_is_reused_not_retrained(trained, monkeypatch):
    cache, path, _ = trained
    monkeypatch.setenv("RLT_HAL_CACHE", str(cache))

    def no_training(*_args, **_kwargs):
        raise AssertionError("trained again although the recipe's checkpoint is cached")

    monkeypatch.setattr(train, "train", no_training)
    assert cached_checkpoint("trained", recipe=TINY_RECIPE, trained_cfg=TINY_CFG) == path
    other = train.Recipe(steps=TINY_RECIPE.steps + 1, sources=("topics",))
    with pytest.raises(AssertionError, match="trained again"):  # another recipe, another key
        cached_checkpoint("trained", recipe=other, trained_cfg=TINY_CFG)


def test_training_is_seeded_and_deterministic():
    cfg = preset_config("tiny", vocab_size=64)
    ids = torch.randint(3, 64, (2000,), generator=torch.Generator().manual_seed(1)).tolist()
    recipe = train.Recipe(steps=3, batch=2, seq_len=32, warmup=1)
    a, _ = train.train(cfg, recipe, ids)
    b, _ = train.train(cfg, recipe, ids)
    for name, w in a.state_dict().items():
        assert torch.equal(w, b.state_dict()[name]), name


def test_the_split_is_a_fixed_rule_on_document_names():
    docs = corpus.documents(("topics",))
    train_docs, held = corpus.split(docs)
    assert held and train_docs and not {d.name for d in held} & {d.name for d in train_docs}
    assert all(d.held_out == (zlib.crc32(d.name.encode()) % 10 == 0) for d in docs)
    with pytest.raises(ValueError, match="unknown corpus source"):
        corpus.documents(("wikipedia",))


def test_eval_perplexity_reports_every_loop_and_the_gate(trained, tmp_path):
    out = tmp_path / "ppl.json"
    result = rlt_hal(
        "eval", "--perplexity", "--model", str(trained[1]), "--perplexity-tokens", "128",
        "--adaptive-tokens", "64", "--json", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    modes = report["modes"]
    assert [f"loop {t}" for t in range(4)] == list(modes)[:4]  # 0-based, as --exit-at-step
    assert modes["loop 3"]["agreement_with_last_loop"] == 1.0
    assert 0.0 <= modes["threshold 0.5"]["mean_exit_loop"] <= 3.0
    assert sum(modes["threshold 0.5"]["exit_loop_histogram"]) == pytest.approx(1.0)
    assert report["adaptive"]["tokens"] == 64
    assert "| loop 0 |" in result.stdout and "| loop 4 |" not in result.stdout


def test_toy_checkpoint_refuses_random_preset_flags_with_the_trained_preset(tmp_path):
    result = rlt_hal(
        "toy-checkpoint", str(tmp_path / "x"), "--preset", "trained", "--gate-bias", "1"
    )
    assert result.returncode == 2
    assert "--gate-bias does not apply to --preset trained" in result.stderr
    assert not (tmp_path / "x").exists()


def test_training_shows_its_phases_its_steps_and_a_summary_naming_training_json(trained):
    _, path, log = trained
    lines = log.splitlines()
    assert lines[0].startswith(f"training the 'trained' checkpoint into {path}")
    phases = [line.split(":")[0] for line in lines if line.startswith("[")]
    assert phases == ["[1/4] corpus", "[2/4] tokenizer", "[3/4] training", "[4/4] evaluation"]
    # Not a terminal (as in CI, a pipe or a pty without a size): plain lines, the last step's
    # among them.
    steps = [line for line in lines if line.startswith("  step ")]
    assert steps[0].startswith("  step 1/25, loss ") and steps[-1].startswith("  step 25/25, ")
    assert all("elapsed, ETA " in line for line in steps)
    record = json.loads((path / TRAINING_FILE).read_text())
    assert lines[-1] == training_summary(path)
    assert f"final loss {record['final_loss']:.3f}" in lines[-1]
    ppl = record["held_out"]["trained"]["perplexity_per_loop"][-1]
    assert f"held-out perplexity {ppl:.2f}" in lines[-1] and str(path / TRAINING_FILE) in lines[-1]


def _pty_output(columns: int, steps: int) -> str:
    """What ``TrainingProgress`` writes to a pty that reports ``columns`` (0: no size)."""
    pty = pytest.importorskip("pty")
    import fcntl
    import os
    import select
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    now = [0.0]
    with os.fdopen(slave, "w") as stream:
        progress = TrainingProgress(stream=stream, clock=lambda: now[0], every_s=10)
        progress.start(steps)
        for step in range(steps):
            now[0] += 3.0  # three seconds a step: a plain line every fourth step
            progress.step(step, 5.0 - step / 10)
        progress.close()
        stream.flush()
    out = b""
    # A pty hands written bytes to its master asynchronously (the kernel's flip-buffer work):
    # read until nothing more arrives for a while, not once.
    while select.select([master], [], [], 0.5)[0]:
        try:
            chunk = os.read(master, 1 << 16)
        except OSError:  # the slave side is closed and drained
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    return out.decode()


def test_steps_show_as_plain_lines_on_a_pty_without_a_size_and_as_a_bar_on_a_sized_one():
    plain = _pty_output(columns=0, steps=8).replace("\r\n", "\n")
    assert plain.splitlines() == [
        "  step 1/8, loss 5.000, 3.0s elapsed, ETA 21s",
        "  step 5/8, loss 4.600, 15s elapsed, ETA 9.0s",
        "  step 8/8, loss 4.300, 24s elapsed, ETA 0.0s",
    ]
    bar = _pty_output(columns=100, steps=8)
    assert "training: 100%" in bar and "8/8" in bar and "loss=4.300" in bar
    assert "  step " not in bar


def test_toy_checkpoint_trained_ends_with_the_training_summary(trained, tmp_path, monkeypatch):
    from runtime_glue.cli.main import main
    from runtime_glue.ouro import toy

    monkeypatch.setattr(toy, "cached_checkpoint", lambda preset: trained[1])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["toy-checkpoint", str(tmp_path / "copy"), "--preset", "trained"]) == 0
    last = out.getvalue().splitlines()[-1]
    assert last == training_summary(tmp_path / "copy")
    assert str(tmp_path / "copy" / TRAINING_FILE) in last
