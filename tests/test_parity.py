"""The runtime reproduces the HF-module reference bit for bit: tokens and final-loop logits.

That is the contract of the HF-exact mode (``deterministic=False``); the deterministic mode,
the default on cpu, keeps a different one (tests/test_deterministic.py).
"""

from __future__ import annotations

import pytest

from runtime_glue.engine.llm import LLM
from tests.conftest import PARITY_CONFIGS
from tests.helpers import prompt_of, reference_run, run_parity_case

MAX_NEW = 32


def _block_size(name: str) -> int:
    # Half the configs page at 16 tokens, half at 128, so prompts cross page boundaries either way.
    return 16 if sorted(PARITY_CONFIGS).index(name) % 2 == 0 else 128


@pytest.mark.parametrize("name", sorted(PARITY_CONFIGS))
def test_greedy_tokens_and_logits_match_the_hf_reference(checkpoints, driver_name, name):
    ckpt = checkpoints(name, seed=1, **PARITY_CONFIGS[name])
    block_size = _block_size(name)
    llm = LLM(ckpt, device=driver_name, block_size=block_size, num_blocks=8, deterministic=False)
    prompts = [prompt_of(block_size - 3, seed=2), prompt_of(5, seed=3)]
    run_parity_case(llm, ckpt, prompts, MAX_NEW)


@pytest.mark.parametrize("name", sorted(PARITY_CONFIGS))
def test_reference_sequences_are_varied_enough_to_catch_a_divergence(checkpoints, name):
    ckpt = checkpoints(name, seed=1, **PARITY_CONFIGS[name])
    tokens, _ = reference_run(ckpt, tuple(prompt_of(_block_size(name) - 3, seed=2)), MAX_NEW)
    assert len(set(tokens)) >= 8, f"random weights give a near-constant sequence: {tokens}"


@pytest.mark.parametrize("offset", [-1, 0, 1], ids=["bs-1", "bs", "bs+1"])
def test_prompts_at_page_boundaries_match_the_reference(checkpoints, driver_name, offset):
    ckpt = checkpoints("tiny")
    llm = LLM(ckpt, device=driver_name, block_size=16, num_blocks=8, deterministic=False)
    run_parity_case(llm, ckpt, [prompt_of(16 + offset, seed=7)], 20)


def test_a_sharded_checkpoint_gives_the_same_tokens_as_a_single_file(checkpoints, tmp_path):
    from runtime_glue.ouro.config import OuroConfig
    from runtime_glue.ouro.toy import write_checkpoint

    single = checkpoints("tiny")
    sharded = write_checkpoint(tmp_path / "sharded", OuroConfig.from_dir(single), seed=0, shards=3)
    assert (sharded / "model.safetensors.index.json").is_file()
    prompt = [prompt_of(9, seed=4)]
    a = LLM(single, device="cpu", block_size=16, num_blocks=4).generate(prompt)
    b = LLM(sharded, device="cpu", block_size=16, num_blocks=4).generate(prompt)
    assert a[0].token_ids == b[0].token_ids
