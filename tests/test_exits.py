"""Ouro's exit gate: each exit mode against the HF-module reference, bit for bit, per-token exit
loops, and adaptive depth that runs fewer loops for tokens that exit."""

from __future__ import annotations

import pytest
import torch

from runtime_glue.checks.parity import within_tolerance
from runtime_glue.checks.reference import OuroReference
from runtime_glue.engine.llm import LLM
from runtime_glue.engine.sampling import SamplingParams
from runtime_glue.ouro import exits
from runtime_glue.ouro.config import OuroConfig
from tests.conftest import PARITY_CONFIGS
from tests.helpers import prompt_of, request_slots

MODES = {
    "the config's default (threshold 1.0)": {},
    "exit at loop 0": dict(exit_at_step=0),
    "exit at loop 2": dict(exit_at_step=2),
    "threshold 0.3": dict(exit_threshold=0.3),
    "threshold 0.6": dict(exit_threshold=0.6),
    "weighted": dict(weighted_exit=True),
}
MAX_NEW = 12


@pytest.fixture(scope="module")
def gqa256(checkpoints):
    name = "gqa-h256-d32-L3-T4"
    return checkpoints(name, seed=1, **PARITY_CONFIGS[name])


def _reference(ckpt) -> OuroReference:
    return OuroReference(OuroConfig.from_dir(ckpt)).load(ckpt)


def _run(llm, prompt, **mode):
    params = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, **mode)
    return llm.generate([prompt], params, return_logits=True)[0]


@pytest.mark.parametrize("mode", sorted(MODES))
def test_each_exit_mode_equals_the_reference_bit_for_bit(gqa256, driver_name, mode):
    llm = LLM(gqa256, device=driver_name, block_size=16, num_blocks=16, deterministic=False)
    reference = _reference(gqa256)
    for prompt in (prompt_of(21, seed=3), prompt_of(5, seed=4)):
        out = _run(llm, prompt, **MODES[mode])
        tokens, logits, steps = reference.generate(
            prompt, MAX_NEW, with_exit_steps=True, **MODES[mode]
        )
        assert list(out.token_ids) == tokens
        assert torch.equal(out.logits, logits)
        assert list(out.exit_steps) == steps
    if mode.startswith("threshold"):
        assert len(set(out.exit_steps)) > 1, "a threshold that never varies tests too little"


def test_without_config_defaults_a_request_that_chooses_nothing_reads_the_last_loop(checkpoints):
    ckpt = checkpoints("tiny-no-exit", early_exit_threshold=None)
    llm = LLM(ckpt, block_size=16, num_blocks=8, deterministic=False)
    assert llm.plan.exit_defaults.kind == "last"
    out = _run(llm, prompt_of(9))
    tokens, logits = _reference(ckpt).generate(prompt_of(9), MAX_NEW)
    assert list(out.token_ids) == tokens and torch.equal(out.logits, logits)
    assert set(out.exit_steps) == {llm.config.total_ut_steps - 1}


def test_a_requests_own_exit_mode_wins_and_a_request_choosing_none_gets_the_default():
    default = exits.ExitMode(threshold=0.6)
    assert exits.ExitMode(step=2).or_default(default) == exits.ExitMode(step=2)
    assert exits.ExitMode(weighted=True).or_default(default).kind == "weighted"
    assert exits.ExitMode().or_default(default) is default


def test_a_batch_mixing_modes_keeps_each_requests_own(gqa256, driver_name):
    prompts = [prompt_of(7 + 5 * i, seed=20 + i) for i in range(len(MODES))]
    jobs = list(zip(prompts, MODES.values(), strict=True))
    # Deterministic mode: each request gets, in the batch, the bits it gets alone.
    det = LLM(gqa256, device=driver_name, block_size=16, num_blocks=64, deterministic=True)
    for req, (prompt, mode) in zip(_batched(det, jobs), jobs, strict=True):
        alone = _run(det, prompt, **mode)
        assert tuple(req.output_ids) == alone.token_ids
        assert torch.equal(torch.stack(req.logits), alone.logits)
        assert tuple(req.exit_steps) == alone.exit_steps
    # HF-exact mode: batched, each request stays within the tolerance of the reference.
    exact = LLM(gqa256, device=driver_name, block_size=16, num_blocks=64, deterministic=False)
    reference = _reference(gqa256)
    for (prompt, mode), req in zip(jobs, _batched(exact, jobs), strict=True):
        tokens, logits = reference.generate(prompt, MAX_NEW, **mode)
        got = torch.stack(req.logits)
        assert within_tolerance(tokens, logits, tuple(req.output_ids), got, 0.5).passed


def _batched(llm, jobs):
    """Run ``jobs`` (prompt, exit mode) in one batch; the engine's requests, in order."""
    eng = llm.engine
    for i, (prompt, mode) in enumerate(jobs):
        params = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, **mode)
        eng.add_request(f"b{i}", prompt, params, return_logits=True)
    reqs = [eng.requests[f"b{i}"] for i in range(len(jobs))]
    while eng.has_unfinished():
        eng.step()
    return reqs


def test_a_planted_error_in_the_exit_distribution_is_caught(gqa256, monkeypatch):
    def last_loop_without_the_remainder(gates):  # p_{T-1} = l_{T-1} * prod: a plausible slip
        pdf = exits.exit_pdf.__wrapped__(gates)
        return torch.cat((pdf[..., :-1], pdf[..., -1:] * torch.sigmoid(gates[-1])[..., None]), -1)

    exits.exit_pdf.__wrapped__ = exits.exit_pdf  # the original, for the planted version
    import runtime_glue.ouro.model as model_module

    monkeypatch.setattr(model_module, "exit_pdf", last_loop_without_the_remainder)
    llm = LLM(gqa256, block_size=16, num_blocks=16, deterministic=False)
    reference = _reference(gqa256)
    prompt = prompt_of(21, seed=3)
    out = _run(llm, prompt, weighted_exit=True)
    _, logits = reference.generate(prompt, MAX_NEW, weighted_exit=True)
    assert not torch.equal(out.logits[0], logits[0]), "the planted error went unnoticed"


# -- adaptive depth -------------------------------------------------------------------------


def _count_loops(llm, monkeypatch) -> list[list[int]]:
    """Record, per model forward, the loops that ran (on some rows)."""
    calls: list[list[int]] = []
    real_forward, real_loop = llm.model.forward, llm.model.loop

    def forward(step):
        calls.append([])
        return real_forward(step)

    def loop(t, h, *args):
        calls[-1].append(t)
        return real_loop(t, h, *args)

    monkeypatch.setattr(llm.model, "forward", forward)
    monkeypatch.setattr(llm.model, "loop", loop)
    return calls


@pytest.mark.parametrize("deterministic", [False, True], ids=["hf-exact", "deterministic"])
def test_adaptive_depth_runs_exactly_the_loops_the_threshold_says(
    gqa256, driver_name, deterministic, monkeypatch
):
    llm = LLM(
        gqa256,
        device=driver_name,
        block_size=16,
        num_blocks=16,
        deterministic=deterministic,
        adaptive_depth=True,
        exit_threshold=0.5,
    )
    loops = _count_loops(llm, monkeypatch)
    out = _run(llm, prompt_of(21, seed=3))
    T = llm.config.total_ut_steps
    assert loops[0] == list(range(T)), "the prompt's prefill runs every loop"
    for step, exit_loop in zip(loops[1:], out.exit_steps[1:], strict=True):
        assert step == list(range(exit_loop + 1)), (step, exit_loop)
    assert min(out.exit_steps[1:]) < T - 1, "no token exited early: the test tests nothing"
    assert llm.engine.num_free_blocks == 16


def test_the_planes_of_skipped_loops_hold_the_exit_loops_keys_and_values(gqa256):
    llm = LLM(gqa256, block_size=16, num_blocks=16, adaptive_depth=True, exit_threshold=0.5)
    eng, cfg = llm.engine, llm.config
    eng.add_request("r", prompt_of(21, seed=3), SamplingParams(max_tokens=8, ignore_eos=True))
    req = eng.requests["r"]
    L, T = cfg.num_hidden_layers, cfg.total_ut_steps
    checked = 0
    while eng.has_unfinished():
        eng.step()
        if req.finished:  # its pages went back: nothing left to look at
            break
        if len(req.output_ids) < 2 or req.exit_steps[-1] == T - 1:
            continue
        t = req.exit_steps[-1]  # the decode step that fed token -2 exited after loop t
        slot = request_slots(llm, req, req.num_computed)[-1:]
        kv = llm.kv_store
        for li in range(L):
            for later in range(t + 1, T):
                assert torch.equal(
                    kv.key_cache[later * L + li, slot], kv.key_cache[t * L + li, slot]
                )
                assert torch.equal(
                    kv.value_cache[later * L + li, slot], kv.value_cache[t * L + li, slot]
                )
        checked += 1
    assert checked, "no decode step exited early"


def test_adaptive_depth_returns_every_page_only_after_its_fence(tiny_ckpt):
    llm = LLM(
        tiny_ckpt,
        device="npu",
        block_size=16,
        num_blocks=8,
        adaptive_depth=True,
        exit_threshold=0.5,
        driver_options={"emulate": True, "event_delay": 10**9},
    )
    llm.generate([prompt_of(9)], SamplingParams(max_tokens=6, ignore_eos=True))
    assert llm.engine.num_free_blocks == 7, "pages came back before their step's event"
    llm.driver.device.synchronize()
    assert llm.engine.num_free_blocks == 8


def test_generate_shows_each_tokens_exit_loop_as_the_api_numbers_it(tiny_ckpt):
    from tests.helpers import rlt_hal

    proc = rlt_hal(
        "generate",
        "--model",
        str(tiny_ckpt),
        "--prompt-ids",
        "5,6,7",
        "--max-tokens",
        "4",
        "--exit-threshold",
        "0.5",
        "--show-depth",
        "--ignore-eos",
        "--block-size",
        "16",
    )
    assert proc.returncode == 0, proc.stderr
    depths = [int(x) for x in __import__("re").findall(r"\[(\d)\]", proc.stdout)]
    llm = LLM(tiny_ckpt, block_size=16, num_blocks=4, exit_threshold=0.5)
    [out] = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert depths == list(out.exit_steps)  # 0-based, the loop numbers the API returns
    assert proc.stdout.endswith("]\n")  # the shell's prompt starts on a line of its own
    assert "exit threshold 0.5 by default" in proc.stderr
