"""Real Ascend hardware: run with ``pytest --run-npu`` on a host with torch_npu and CANN.

These never run on the project's CI (no NPU there); each skips with the flag it needs.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.conftest import PARITY_CONFIGS
from tests.helpers import prompt_of, run_parity_case

pytestmark = pytest.mark.npu


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
def test_engine_parity_with_the_hf_reference_on_the_npu(checkpoints, name):
    from runtime_glue.llm import LLM

    ckpt = checkpoints(name, seed=1, **PARITY_CONFIGS[name])
    llm = LLM(ckpt, device="npu", block_size=128, num_blocks=4)
    # The reference runs on the CPU: a difference here is a device-vs-CPU finding to report
    # with `rlt-hal parity`, not necessarily a driver bug.
    run_parity_case(llm, ckpt, [prompt_of(20, seed=2)], 16)


@pytest.mark.skipif(
    not os.environ.get("VLLM_RLT_OURO_CHECKPOINT"),
    reason="set VLLM_RLT_OURO_CHECKPOINT=/path/to/Ouro-1.4B",
)
def test_a_real_checkpoint_matches_its_own_remote_code_on_the_same_device():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from runtime_glue.llm import LLM
    from runtime_glue.sampling import SamplingParams

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
    llm = LLM(path, device="npu")
    got = llm.generate([ids[0].tolist()], SamplingParams(max_tokens=32, ignore_eos=True))
    assert list(got[0].token_ids)[: len(want)] == want.tolist()
