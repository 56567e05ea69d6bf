"""Deterministic mode: chunk size and batch mix never change a request's tokens or logits.

The mode is the default on cpu (its measured cost is within noise there); with it off, the
HF-exact mode, the same comparisons are allowed to differ in the last bits (within the
engine's stated tolerance); ``rlt-hal parity`` locates where, and docs/determinism.md records
what was measured.
"""

from __future__ import annotations

import attrs
import pytest
import torch
import torch.nn.functional as F

from runtime_glue.llm import LLM
from runtime_glue.sampling import SamplingParams
from tests.conftest import PARITY_CONFIGS
from tests.helpers import prompt_of

CONFIGS = sorted(PARITY_CONFIGS)  # every parity config, two of them at Ouro-1.4B width
PARAMS = SamplingParams(max_tokens=10, ignore_eos=True)


def _llm(ckpt, driver_name, **kw):
    return LLM(ckpt, device=driver_name, block_size=16, num_blocks=64, deterministic=True, **kw)


def _alone(ckpt, driver_name, prompt, params=PARAMS):
    return _llm(ckpt, driver_name).generate([prompt], params, return_logits=True)[0]


@pytest.mark.parametrize("name", CONFIGS)
def test_every_chunk_size_gives_the_bits_of_full_prefill(checkpoints, driver_name, name):
    ckpt = checkpoints(name, seed=1, **PARITY_CONFIGS[name])
    prompts = [prompt_of(260, seed=1), prompt_of(23, seed=2)]  # 260 > the largest chunk
    llm = _llm(ckpt, driver_name)
    want = llm.generate(prompts, PARAMS, return_logits=True)
    for chunk in (1, 16, 64, 128, 256):
        llm.engine.config = attrs.evolve(llm.engine.config, prefill_chunk_size=chunk)
        got = llm.generate(prompts, PARAMS, return_logits=True)
        for g, w in zip(got, want, strict=True):
            assert g.token_ids == w.token_ids, f"chunk {chunk}"
            assert torch.equal(g.logits, w.logits), f"chunk {chunk}"


@pytest.mark.parametrize("name", CONFIGS)
def test_requests_joining_and_leaving_a_batch_get_the_bits_they_get_alone(
    checkpoints, driver_name, name
):
    ckpt = checkpoints(name, seed=1, **PARITY_CONFIGS[name])
    jobs = [
        (
            prompt_of(5 + 7 * i, seed=10 + i),
            SamplingParams(max_tokens=4 + 2 * (i % 3), ignore_eos=True),
        )
        for i in range(8)
    ]
    eng = _llm(ckpt, driver_name, prefill_chunk_size=16).engine
    reqs, sizes, step = {}, set(), 0
    while len(reqs) < len(jobs) or eng.has_unfinished():
        if step % 2 == 0 and len(reqs) < len(jobs):  # one joins every other step
            i = len(reqs)
            eng.add_request(f"r{i}", jobs[i][0], jobs[i][1], return_logits=True)
            reqs[i] = eng.requests[f"r{i}"]
        sizes.add(len(eng.running) + len(eng.waiting))
        eng.step()
        step += 1
    assert {2, 3, 4}.issubset(sizes), f"the batch never mixed enough requests: {sizes}"
    for i, (prompt, params) in enumerate(jobs):
        want = _alone(ckpt, driver_name, prompt, params)
        assert tuple(reqs[i].output_ids) == want.token_ids, f"request {i}"
        assert torch.equal(torch.stack(reqs[i].logits), want.logits), f"request {i}"


def test_with_the_mode_off_chunking_stays_within_the_engines_tolerance(checkpoints):
    from runtime_glue.parity import compare
    from tests.test_engine import LOGIT_TOLERANCE

    name = "gqa-h256-d32-L3-T4"
    ckpt = checkpoints(name, seed=1, **PARITY_CONFIGS[name])
    full = LLM(ckpt, block_size=16, num_blocks=64, deterministic=False)
    chunked = LLM(ckpt, block_size=16, num_blocks=64, prefill_chunk_size=1, deterministic=False)
    report = compare(full, chunked, prompt_of(37, seed=1), max_tokens=10)
    print(report.describe())  # where the bits part (measured: attention, see the docs)
    assert report.max_logit_diff <= LOGIT_TOLERANCE


def test_a_backend_without_deterministic_support_is_refused(tiny_ckpt, monkeypatch):
    from drivers.cpu.driver import CpuEagerBackend

    monkeypatch.setattr(CpuEagerBackend, "supports_deterministic", False)
    with pytest.raises(ValueError, match="'cpu_eager' does not support deterministic mode"):
        LLM(tiny_ckpt, deterministic=True)


def test_the_mode_is_the_default_only_where_its_backend_measured_it_cheap(tiny_ckpt, monkeypatch):
    assert LLM(tiny_ckpt, device="cpu", num_blocks=4).mode == "deterministic"
    assert LLM(tiny_ckpt, device="cpu", num_blocks=4, deterministic=False).mode == "hf-exact"
    monkeypatch.setenv("RLT_HAL_NPU_EMULATE", "1")
    assert LLM(tiny_ckpt, device="npu", num_blocks=4).mode == "hf-exact"
    assert LLM(tiny_ckpt, device="npu", num_blocks=4, deterministic=True).mode == "deterministic"


def _gemv_differs(monkeypatch):
    """Test double for a device whose one-row linear rounds differently from its GEMM."""
    real = F.linear

    def gemv_differs(x, w, bias=None):
        out = real(x, w)
        return out + 1 if x.shape[0] == 1 else out

    monkeypatch.setattr(F, "linear", gemv_differs)


def test_a_default_mode_that_fails_its_check_falls_back_to_hf_exact(tiny_ckpt, monkeypatch, caplog):
    _gemv_differs(monkeypatch)
    # By default padding is not worth it (it doubles one-row calls): the mode stays off.
    assert LLM(tiny_ckpt, device="cpu", num_blocks=4, linear="torch").mode == "hf-exact"
    assert "deterministic mode is off by default here" in caplog.text
    assert "linear [" in caplog.text
    # Asked for explicitly, the mode pays for the padding.
    llm = LLM(tiny_ckpt, device="cpu", num_blocks=4, deterministic=True, linear="torch")
    assert llm.mode == "deterministic" and llm.model.linear.pads is F.linear


def test_kernels_that_are_not_row_invariant_are_detected():
    from runtime_glue.determinism import choose_linear

    w = torch.randn(8, 16).bfloat16()

    def coupled_norm(x):  # a "norm" whose rows depend on the call's other rows
        return x - x.mean()

    with pytest.raises(RuntimeError, match="rms_norm gives different bits for the same row"):
        choose_linear([w], coupled_norm)


def test_a_linear_that_is_only_invariant_when_padded_gets_the_padding(monkeypatch):
    from runtime_glue import determinism

    _gemv_differs(monkeypatch)
    w = torch.randn(8, 16).bfloat16()
    chosen = determinism.choose_linear([w], lambda x: x * 2)
    assert chosen.pads is F.linear
