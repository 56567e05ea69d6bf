"""The trained preset's recipe, run tiny: a few steps on the reference manual's topics.

CI never trains the full preset (minutes); these tests train the same code path for seconds
and check what the full run relies on: the loss falls, the files load through the real loader
and tokenizer, the runtime computes what the training forward computes, the cache is reused.
"""

from __future__ import annotations

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
from runtime_glue.ouro.toy import TRAINING_FILE, cached_checkpoint, preset_config
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
    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RLT_HAL_CACHE", str(cache))
        path = cached_checkpoint("trained", recipe=TINY_RECIPE, trained_cfg=TINY_CFG)
    return cache, path


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
        assert theirs[f"loop {t + 1}"]["perplexity"] == pytest.approx(mine[t], rel=PERPLEXITY_RTOL)


def test_the_cache_is_reused_not_retrained(trained, monkeypatch):
    cache, path = trained
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
    a, _ = train.train(cfg, recipe, ids, progress=False)
    b, _ = train.train(cfg, recipe, ids, progress=False)
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
    assert [f"loop {t}" for t in range(1, 5)] == list(modes)[:4]
    assert modes["loop 4"]["agreement_with_last_loop"] == 1.0
    assert 1.0 <= modes["threshold 0.5"]["mean_exit_loop"] <= 4.0
    assert sum(modes["threshold 0.5"]["exit_loop_histogram"]) == pytest.approx(1.0)
    assert report["adaptive"]["tokens"] == 64
    assert "| loop 1 |" in result.stdout


def test_toy_checkpoint_refuses_random_preset_flags_with_the_trained_preset(tmp_path):
    result = rlt_hal(
        "toy-checkpoint", str(tmp_path / "x"), "--preset", "trained", "--gate-bias", "1"
    )
    assert result.returncode == 2
    assert "--gate-bias does not apply to --preset trained" in result.stderr
    assert not (tmp_path / "x").exists()
