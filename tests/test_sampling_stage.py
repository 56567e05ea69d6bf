"""The one sampling stage (``runtime_glue.engine.sampling``): penalties, bias, min_tokens,
min_p and stop ids; log-probabilities of generated and prompt tokens; several samples of one
prompt sharing its K/V. Each the same under speculation, bit for bit in deterministic mode."""

from __future__ import annotations

import math

import pytest
import torch

from runtime_glue.engine.llm import LLM
from runtime_glue.engine.sampling import SamplingParams, process, sample
from tests.helpers import prompt_of

PROMPT = prompt_of(20, seed=3)


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    return LLM(tiny_ckpt, device="cpu", block_size=16, num_blocks=64)


@pytest.fixture(scope="module")
def spec(tiny_ckpt):
    return LLM(
        tiny_ckpt, device="cpu", block_size=16, num_blocks=64, speculative_loops=1,
        num_speculative_tokens=3,
    )  # fmt: skip


# -- the stage on one row -------------------------------------------------------------------


def test_each_control_changes_the_logits_as_vllm_and_openai_define_it():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0])
    prompt, history = [0], [3, 3, 1]
    rp = process(logits, SamplingParams(repetition_penalty=2.0), prompt, history)
    assert rp.tolist() == [1.0, -2.0, 0.5, 1.5, -2.0]  # seen: /2 if > 0, *2 if < 0
    fp = process(logits, SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), [], history)
    assert fp.tolist() == [2.0, -1.75, 0.5, 1.75, -2.0]  # count * 0.5 + 0.25 if present
    bias = process(logits, SamplingParams(logit_bias={"4": 10.0}), [], [])
    assert bias.tolist() == [2.0, -1.0, 0.5, 3.0, 8.0]
    params = SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=[2])
    early = process(logits, params, [], [7], eos_token_ids=(3,))
    assert early[2] == early[3] == -math.inf and early[0] == 2.0
    assert torch.equal(process(logits, params, [], [7, 7], eos_token_ids=(3,)), logits)
    allowed = torch.tensor([False, True, False, False, True])
    masked = process(logits, SamplingParams(), [], [], allowed=allowed)
    assert sample(masked, SamplingParams()) == 1
    assert logits.tolist() == [2.0, -1.0, 0.5, 3.0, -2.0], "the stage writes a new tensor"


def test_min_p_keeps_only_tokens_within_its_share_of_the_most_likely():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    params = SamplingParams(temperature=1.0, min_p=0.5)  # keeps p >= 0.25: tokens 0 and 1
    drawn = {sample(logits, params, seed, 9) for seed in range(200)}
    assert drawn == {0, 1}


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("presence_penalty", 2.5, r"presence_penalty must be in \[-2, 2\]"),
        ("frequency_penalty", -3.0, r"frequency_penalty must be in \[-2, 2\]"),
        ("repetition_penalty", 0.0, "repetition_penalty must be > 0"),
        ("logit_bias", {5: 101.0}, r"logit_bias of token 5 must be in \[-100, 100\]"),
        ("min_tokens", 40, r"min_tokens must be in \[0, max_tokens \(16\)\]"),
        ("min_p", 1.5, r"min_p must be in \[0, 1\]"),
        ("logprobs", 21, r"logprobs must be in \[0, 20\]"),
        ("max_tokens", 0, r"max_tokens must be > 0, got 0 \(0 only with prompt_logprobs\)"),
        ("n", 0, "n must be >= 1"),
    ],
)
def test_out_of_range_controls_are_refused_naming_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})


# -- in the engine ---------------------------------------------------------------------------


def test_logit_bias_min_tokens_and_stop_token_ids_act_on_generation(llm):
    forced = llm.generate([PROMPT], SamplingParams(max_tokens=4, logit_bias={42: 100.0}))[0]
    assert forced.token_ids == (42, 42, 42, 42)
    stop = SamplingParams(max_tokens=8, logit_bias={42: 100.0}, stop_token_ids=[42], min_tokens=3)
    out = llm.generate([PROMPT], stop)[0]
    assert out.token_ids[-1] == 42 and len(out.token_ids) == 4 and out.finish_reason == "stop"
    assert 42 not in out.token_ids[:3]  # masked until min_tokens were generated


def test_penalties_change_the_output_and_speculation_keeps_their_bits(llm, spec):
    plain = llm.generate([PROMPT], SamplingParams(max_tokens=24, ignore_eos=True))[0]
    x = plain.token_ids[0]
    bias = dict(max_tokens=24, ignore_eos=True, logit_bias={x: 6.0})
    biased = llm.generate([PROMPT], SamplingParams(**bias))[0]
    penalties = dict(presence_penalty=1.0, frequency_penalty=2.0, repetition_penalty=1.5)
    penalised = SamplingParams(**bias, **penalties)
    want = llm.generate([PROMPT], penalised, return_logits=True)[0]
    assert want.token_ids.count(x) < biased.token_ids.count(x), (biased, want)
    got = spec.generate([PROMPT], penalised, return_logits=True)[0]
    assert got.token_ids == want.token_ids and torch.equal(got.logits, want.logits)
    seeded = SamplingParams(**bias, **penalties, temperature=0.9, seed=11)
    assert (
        spec.generate([PROMPT], seeded)[0].token_ids == llm.generate([PROMPT], seeded)[0].token_ids
    )


def test_logprobs_are_the_log_softmax_of_the_exit_loops_logits_with_ranks(llm, spec):
    params = SamplingParams(max_tokens=6, logprobs=3, ignore_eos=True)
    out = llm.generate([PROMPT], params, return_logits=True)[0]
    for token, row, logits in zip(out.token_ids, out.logprobs, out.logits, strict=True):
        lp = torch.log_softmax(logits, -1)
        assert next(iter(row)) == token and row[token].logprob == float(lp[token])
        assert row[token].rank == int((lp > lp[token]).sum()) + 1
        top = torch.topk(lp, 3)
        assert [row[i].rank for i in top.indices.tolist()] == [1, 2, 3]
        assert row[token].decoded_token == llm.tokenizer.decode([token])
    assert spec.generate([PROMPT], params)[0].logprobs == out.logprobs


def test_prompt_logprobs_score_every_prompt_token_whatever_the_chunks_or_the_cache(tiny_ckpt):
    params = SamplingParams(max_tokens=1, prompt_logprobs=2)
    whole = LLM(tiny_ckpt, block_size=16, num_blocks=64, enable_prefix_caching=True)
    first = whole.generate([PROMPT], params)[0]
    assert first.prompt_logprobs[0] is None and len(first.prompt_logprobs) == len(PROMPT)
    for p, row in enumerate(first.prompt_logprobs[1:], start=1):
        assert PROMPT[p] in row
    again = whole.generate([PROMPT], params)[0]  # its blocks cached now: still every position
    chunked = LLM(tiny_ckpt, block_size=16, num_blocks=64, prefill_chunk_size=6)
    assert again.prompt_logprobs == first.prompt_logprobs
    assert chunked.generate([PROMPT], params)[0].prompt_logprobs == first.prompt_logprobs
    only = whole.generate([PROMPT], SamplingParams(max_tokens=0, prompt_logprobs=0))[0]
    assert only.token_ids == () and only.finish_reason == "length"
    for p in range(1, len(PROMPT)):
        token = PROMPT[p]
        assert only.prompt_logprobs[p][token] == first.prompt_logprobs[p][token]


def test_n_samples_share_the_prompts_kv_and_equal_separate_requests(tiny_ckpt):
    llm = LLM(tiny_ckpt, block_size=16, num_blocks=64)
    params = SamplingParams(max_tokens=8, n=3, temperature=0.8, seed=21, ignore_eos=True)
    per_prompt = llm.generate([PROMPT, prompt_of(9, seed=4)], params)
    assert [[o.index for o in r.outputs] for r in per_prompt] == [[0, 1, 2], [0, 1, 2]]
    assert llm.engine.stats["forked"] == 4  # the prompts computed once each
    for r in per_prompt:
        for o in r.outputs:
            assert o.prompt_token_ids == r.prompt_token_ids
            alone = SamplingParams(
                max_tokens=8, temperature=0.8, seed=21 + o.index, ignore_eos=True
            )
            assert llm.generate([list(r.prompt_token_ids)], alone)[0].token_ids == o.token_ids
    assert len({o.token_ids for o in per_prompt[0].outputs}) == 3
    llm.engine.audit_pages()
    assert llm.engine.num_free_blocks == 64


# -- structured outputs in the stage ---------------------------------------------------------

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "kind": {"enum": ["cat", "dog", "owl"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        "home": {
            "type": "object",
            "properties": {"floor": {"enum": [1, 2, 3]}},
            "required": ["floor"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "kind", "tags", "home"],
    "additionalProperties": False,
}
JSON = {"json": SCHEMA, "disable_any_whitespace": True}
REGEX = {"regex": "[0-9]{3}-[a-z]{2,5}"}


def test_json_schema_outputs_always_parse_and_validate_while_sampling(llm):
    import json

    jsonschema = pytest.importorskip("jsonschema")
    for seed in range(12):
        params = SamplingParams(max_tokens=80, temperature=1.0, seed=seed, structured_outputs=JSON)
        out = llm.generate([PROMPT], params)[0]
        jsonschema.validate(json.loads(out.text), SCHEMA)
        assert out.finish_reason == "stop", out


def test_a_regex_and_a_choice_are_matched_exactly(llm):
    import re

    for seed in range(6):
        p = SamplingParams(max_tokens=30, temperature=1.0, seed=seed, structured_outputs=REGEX)
        assert re.fullmatch(REGEX["regex"], llm.generate([PROMPT], p)[0].text)
    choice = {"choice": ["yes", "no", "not sure"]}
    for seed in range(6):
        p = SamplingParams(max_tokens=10, temperature=1.0, seed=seed, structured_outputs=choice)
        assert llm.generate([PROMPT], p)[0].text in choice["choice"]


@pytest.mark.parametrize("rule", [JSON, REGEX], ids=["json", "regex"])
def test_constrained_speculation_gives_constrained_plain_decodings_bits(llm, spec, rule):
    for params in (
        SamplingParams(max_tokens=40, structured_outputs=rule),
        SamplingParams(max_tokens=40, temperature=0.9, seed=3, structured_outputs=rule),
    ):
        want = llm.generate([PROMPT], params, return_logits=True)[0]
        got = spec.generate([PROMPT], params, return_logits=True)[0]
        assert got.token_ids == want.token_ids and torch.equal(got.logits, want.logits)


def test_a_verify_row_masked_as_if_no_draft_came_before_it_is_caught(llm, spec, monkeypatch):
    """Planted bug: a speculative row gets the matcher's current mask instead of the mask
    after the drafts before it (what "not rolled forward" and "not rolled back" both give)."""
    from runtime_glue.engine import structured

    monkeypatch.setattr(structured.Matcher, "allowed_after", lambda self, drafted: self.allowed())
    params = SamplingParams(max_tokens=40, structured_outputs=REGEX)
    want = llm.generate([PROMPT], params)[0]
    try:
        got = spec.generate([PROMPT], params)[0]
    except RuntimeError as exc:  # a token the grammar refuses was emitted: the engine ends it
        assert "refused token" in str(exc)
    else:
        assert got.token_ids != want.token_ids


def test_a_finished_grammar_ends_the_request_even_when_eos_is_ignored(llm):
    params = SamplingParams(
        max_tokens=30, ignore_eos=True, structured_outputs={"choice": ["yes", "no"]}
    )
    out = llm.generate([PROMPT], params)[0]
    assert out.finish_reason == "stop" and len(out.token_ids) < 30
