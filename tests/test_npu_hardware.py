"""Real Ascend hardware: run with ``pytest --run-npu`` on a host with torch_npu and CANN.

Bits are compared only on one device: rlt-hal on the NPU against the HF-module reference on the
same NPU. Across devices (the NPU against the cpu) the kernels round differently, so those
comparisons hold to ``acceptance.DEFAULT_TOLERANCE``. These never run on the project's CI (no
NPU there); each skips with the flag it needs.
"""

from __future__ import annotations

import os

import pytest
import torch

from runtime_glue.checks.parity import within_tolerance
from runtime_glue.checks.reference import OuroReference
from runtime_glue.cli.acceptance import DEFAULT_TOLERANCE, acceptance
from runtime_glue.engine.llm import LLM
from runtime_glue.engine.sampling import SamplingParams
from runtime_glue.ouro.config import OuroConfig
from tests.conftest import PARITY_CONFIGS
from tests.helpers import prompt_of

pytestmark = pytest.mark.npu
PARAMS = SamplingParams(max_tokens=16, ignore_eos=True)


def _driver():
    from drivers.npu.driver import create

    driver = create(emulate=False)
    driver.device.initialize()
    return driver


def test_the_real_driver_initialises_and_its_fences_complete():
    driver = _driver()
    assert not driver.device.emulated
    fence = driver.device.record_fence()
    fence.wait()
    assert fence.done()


def test_scatter_nd_round_trip_on_the_device():
    from hal.types import KVLayout

    kv = _driver().create_kv_store(KVLayout(2, 4, 16, 2, 128))
    slots = torch.tensor([0, 15, 16, 63], device=kv.device)
    rows = torch.randn(4, 2, 128, dtype=torch.bfloat16, device=kv.device)
    kv.write(1, rows, rows, slots)
    k, _ = kv.gather(1, slots)
    assert torch.equal(k[0].transpose(0, 1).cpu(), rows.cpu())


@pytest.mark.parametrize("name", ["gqa-h64-d32-L2-T4", "wide-h2048-d128-L1-T4"])
def test_greedy_tokens_and_logits_equal_the_reference_on_the_same_npu(checkpoints, name):
    ckpt = checkpoints(name, seed=1, **PARITY_CONFIGS[name])
    llm = LLM(ckpt, device="npu", block_size=128, num_blocks=4, deterministic=False)
    reference = (
        OuroReference(OuroConfig.from_dir(ckpt)).load(ckpt).to(llm.driver.device.torch_device)
    )
    prompt = prompt_of(20, seed=2)
    out = llm.generate([prompt], PARAMS, return_logits=True)[0]
    tokens, logits = reference.generate(prompt, 16)
    assert list(out.token_ids) == tokens
    assert torch.equal(out.logits, logits.cpu())


@pytest.mark.parametrize("name", ["gqa-h64-d32-L2-T4", "wide-h2048-d128-L1-T4"])
def test_the_npu_stays_within_the_stated_tolerance_of_the_cpu(checkpoints, name):
    ckpt = checkpoints(name, seed=1, **PARITY_CONFIGS[name])
    prompt = prompt_of(20, seed=2)
    outs = [
        LLM(ckpt, device=d, block_size=128, num_blocks=4, deterministic=False).generate(
            [prompt], PARAMS, return_logits=True
        )[0]
        for d in ("cpu", "npu")
    ]
    check = within_tolerance(
        outs[0].token_ids, outs[0].logits, outs[1].token_ids, outs[1].logits, DEFAULT_TOLERANCE
    )
    assert check.passed, check


def test_the_acceptance_kit_passes_on_the_npu(checkpoints):
    name = "wide-gqa-h2048-d128-L2-T2"
    report = acceptance(checkpoints(name, seed=1, **PARITY_CONFIGS[name]), "npu", limit=8)
    assert report["passed"], [(p["name"], p["summary"]) for p in report["parts"]]


@pytest.mark.skipif(
    not os.environ.get("VLLM_RLT_OURO_CHECKPOINT"),
    reason="set VLLM_RLT_OURO_CHECKPOINT=/path/to/Ouro-1.4B",
)
def test_a_real_checkpoint_matches_its_own_remote_code_on_the_same_device():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = os.environ["VLLM_RLT_OURO_CHECKPOINT"]
    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=True)
    hf = (
        AutoModelForCausalLM.from_pretrained(
            path, trust_remote_code=True, torch_dtype=torch.bfloat16, attn_implementation="eager"
        )
        .to("npu")
        .eval()
    )
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    want = hf.generate(ids.to("npu"), max_new_tokens=32, do_sample=False)[0, ids.shape[1] :]
    llm = LLM(path, device="npu", deterministic=False)
    got = llm.generate([ids[0].tolist()], SamplingParams(max_tokens=32, ignore_eos=True))
    assert list(got[0].token_ids)[: len(want)] == want.tolist()
