"""Sampling and stopping: seeded reproducibility, top-k/top-p, EOS, stop strings, max_tokens."""

from __future__ import annotations

import pytest
import torch

from runtime_glue.engine.llm import LLM
from runtime_glue.engine.sampling import SamplingParams, sample
from tests.helpers import prompt_of


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    return LLM(tiny_ckpt, block_size=16, num_blocks=32)


def test_a_seed_makes_sampling_reproducible_and_different_seeds_differ(llm):
    prompt = [prompt_of(6, seed=1)]

    def run(seed):
        p = SamplingParams(max_tokens=16, temperature=1.0, seed=seed, ignore_eos=True)
        return llm.generate(prompt, p)[0].token_ids

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_seeded_sampling_does_not_depend_on_the_other_requests_in_the_batch(llm):
    p = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True)
    alone = llm.generate([prompt_of(6, seed=1)], p)[0].token_ids
    batch = llm.generate([prompt_of(9, seed=2), prompt_of(6, seed=1)], p)[1].token_ids
    assert alone == batch


def test_top_k_one_is_greedy(llm):
    prompt = [prompt_of(6, seed=4)]
    greedy = llm.generate(prompt, SamplingParams(max_tokens=12, ignore_eos=True))
    top1 = llm.generate(
        prompt, SamplingParams(max_tokens=12, temperature=1.5, top_k=1, seed=0, ignore_eos=True)
    )
    assert greedy[0].token_ids == top1[0].token_ids


def test_top_k_and_top_p_only_draw_from_the_kept_tokens():
    logits = torch.tensor([5.0, 4.0, 3.0, 0.0, -1.0])
    top_k = SamplingParams(temperature=5.0, top_k=2)
    draws = {sample(logits, top_k, seed=0, position=p) for p in range(200)}
    assert draws == {0, 1}
    probs = torch.softmax(logits, -1)  # 0.66, 0.24, 0.09, ...: top_p 0.8 keeps two tokens
    assert probs[0] < 0.8 < probs[0] + probs[1]
    top_p = SamplingParams(temperature=1.0, top_p=0.8)
    draws = {sample(logits, top_p, seed=1, position=p) for p in range(300)}
    assert draws == {0, 1}


def test_a_sampled_token_is_a_function_of_its_logits_seed_and_position():
    logits = torch.randn(64, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.0)
    first = [sample(logits, params, seed=5, position=p) for p in range(50)]
    assert first == [sample(logits, params, seed=5, position=p) for p in range(50)]
    assert first != [sample(logits, params, seed=6, position=p) for p in range(50)]
    assert len(set(first)) > 10  # positions draw independently


def test_gumbel_max_draws_follow_the_softmax():
    """Across positions, a token's frequency is its probability (2000 seeded draws; the
    bound is about five standard deviations)."""
    logits = torch.tensor([1.0, 0.0, -1.0, 0.5])
    probs = torch.softmax(logits, -1)
    params = SamplingParams(temperature=1.0)
    draws = torch.tensor([sample(logits, params, seed=3, position=p) for p in range(2000)])
    freq = torch.bincount(draws, minlength=4).float() / 2000
    assert (freq - probs).abs().max() < 0.05


def test_generation_stops_at_the_first_eos_unless_told_to_ignore_it(llm):
    prompt = [prompt_of(5, seed=9)]
    free = llm.generate(prompt, SamplingParams(max_tokens=12, ignore_eos=True))[0]
    eos = free.token_ids[4]
    engine = llm.engine
    saved = engine.sampler.eos
    engine.sampler.eos = frozenset({eos, 999_999})  # eos_token_id may be a list
    try:
        stopped = llm.generate(prompt, SamplingParams(max_tokens=12))[0]
        ignored = llm.generate(prompt, SamplingParams(max_tokens=12, ignore_eos=True))[0]
    finally:
        engine.sampler.eos = saved
    first = free.token_ids.index(eos)
    assert stopped.token_ids == free.token_ids[: first + 1]
    assert stopped.finish_reason == "stop"
    assert ignored.token_ids == free.token_ids and ignored.finish_reason == "length"


def test_the_checkpoints_eos_list_includes_chatml_im_end(llm):
    assert llm.config.eos_token_ids == (0, 2)
    assert llm.tokenizer.convert_ids_to_tokens(2) == "<|im_end|>"


def test_a_stop_string_ends_generation_and_is_cut_from_the_text(llm):
    prompt = [prompt_of(5, seed=9)]
    free = llm.generate(prompt, SamplingParams(max_tokens=16, ignore_eos=True))[0]
    stop = free.text[len(free.text) // 2 : len(free.text) // 2 + 2]
    assert stop.strip(), f"pick a visible stop string from {free.text!r}"
    out = llm.generate(prompt, SamplingParams(max_tokens=16, stop=[stop], ignore_eos=True))[0]
    assert out.finish_reason == "stop"
    assert out.text == free.text[: free.text.find(stop)]
    assert len(out.token_ids) < len(free.token_ids)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("temperature", -0.1, "temperature must be >= 0"),
        ("top_p", 0.0, r"top_p must be in \(0, 1\]"),
        ("top_k", -2, "top_k must be -1, 0"),
        ("stop", [""], "stop strings must be non-empty"),
    ],
)
def test_invalid_sampling_parameters_are_rejected(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})
