"""Real CUDA GPU: run with ``pytest --run-cuda`` (and ``--pyargs hal.testing --rlt-driver
cuda`` for the kit). Results are recorded in docs/cuda.md when a GPU was available."""

from __future__ import annotations

import pytest
import torch

from runtime_glue.engine.llm import LLM
from runtime_glue.engine.sampling import SamplingParams
from runtime_glue.ouro.config import OuroConfig
from tests.conftest import PARITY_CONFIGS
from tests.helpers import prompt_of
from tests.reference.ouro_hf import OuroReference

pytestmark = pytest.mark.cuda


def test_the_cuda_driver_initialises_with_event_fences():
    from drivers.cuda.driver import create

    driver = create(index=0)
    driver.device.initialize()
    fence = driver.device.record_fence()
    fence.wait()
    assert fence.done() and driver.device.torch_device.type == "cuda"


@pytest.mark.parametrize("name", ["gqa-h64-d32-L2-T4", "wide-h2048-d128-L1-T4"])
def test_cuda_eager_matches_the_hf_reference_on_the_same_gpu(checkpoints, name):
    ckpt = checkpoints(name, seed=1, **PARITY_CONFIGS[name])
    ref = OuroReference(OuroConfig.from_dir(ckpt)).load(ckpt).to("cuda")
    prompt = prompt_of(20, seed=2)
    want_tokens, want_logits = ref.generate(prompt, 16)
    llm = LLM(ckpt, device="cuda", attention_backend="cuda_eager", block_size=16, num_blocks=8)
    got = llm.generate(
        [prompt], SamplingParams(max_tokens=16, ignore_eos=True), return_logits=True
    )[0]
    assert list(got.token_ids) == want_tokens
    assert torch.equal(got.logits, want_logits)


def test_cuda_sdpa_stays_close_to_cuda_eager(checkpoints):
    name = "wide-h2048-d128-L1-T4"
    ckpt = checkpoints(name, seed=1, **PARITY_CONFIGS[name])
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    outs = [
        LLM(ckpt, device="cuda", attention_backend=b, block_size=16, num_blocks=8).generate(
            [prompt_of(20, seed=2)], params, return_logits=True
        )[0]
        for b in ("cuda_eager", "cuda_sdpa")
    ]
    assert (outs[0].logits[0] - outs[1].logits[0]).abs().max() < 0.5
