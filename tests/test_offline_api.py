"""vLLM's offline API shape (issue 45): ``LLM.generate`` returns one ``RequestOutput`` per
prompt with its ``n`` samples in ``outputs``; ``LLM.chat`` renders conversations with the chat
template; a vLLM-style script runs unchanged but for its import."""

from __future__ import annotations

import math
import runpy
import sys
from pathlib import Path

import pytest

from runtime_glue import LLM, RequestOutput, SamplingParams
from runtime_glue.engine.core import InvalidRequest
from tests.helpers import prompt_of

SCRIPT = Path(__file__).with_name("data") / "vllm_offline_script.py"
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    return LLM(tiny_ckpt, block_size=16, num_blocks=64)


def test_a_vllm_style_script_runs_unchanged(tiny_ckpt, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), str(tiny_ckpt)])
    runpy.run_path(str(SCRIPT), run_name="__main__")
    lines = capsys.readouterr().out.splitlines()
    samples = [ln for ln in lines if ln.startswith("Prompt: ")]
    assert len(samples) == 6  # 3 prompts x n = 2
    assert {ln.split(", sample ")[1][0] for ln in samples} == {"0", "1"}
    assert "Prompt: 'The capital of France is'" in samples[4]
    chat = [ln for ln in lines if ln.startswith("Chat prompt: ")]
    assert len(chat) == 1 and "Write an essay about the importance" in chat[0]
    assert lines[-1] == "Conversations: 2, finished: True"


def test_one_request_output_per_prompt_with_its_n_samples(llm):
    params = SamplingParams(n=3, max_tokens=5, temperature=0.9, seed=7, ignore_eos=True)
    prompts = ["Hello there", prompt_of(9, seed=2), {"prompt_token_ids": prompt_of(5, seed=3)}]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [type(o) for o in outs] == [RequestOutput] * 3
    assert outs[0].prompt == "Hello there" and outs[1].prompt is None
    assert outs[1].prompt_token_ids == tuple(prompt_of(9, seed=2))
    assert outs[2].prompt_token_ids == tuple(prompt_of(5, seed=3))
    assert len({o.request_id for o in outs}) == 3
    for o in outs:
        assert o.finished and [c.index for c in o.outputs] == [0, 1, 2]
        assert all(len(c.token_ids) == 5 and c.finish_reason == "length" for c in o.outputs)
        m = o.metrics
        assert m.arrival_time <= m.first_token_time <= m.finished_time
        with pytest.raises(AttributeError, match=r"3 outputs .*outputs\[i\]\.text"):
            o.text  # noqa: B018
    # sample j is the request with seed + j (vLLM's rule), alone
    alone = SamplingParams(max_tokens=5, temperature=0.9, seed=9, ignore_eos=True)
    assert llm.generate(prompts[1], alone)[0].token_ids == outs[1].outputs[2].token_ids


def test_one_sample_reads_through_and_params_may_differ_per_prompt(llm):
    a, b = prompt_of(7, seed=4), prompt_of(6, seed=5)
    short = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    outs = llm.generate([a, b], [GREEDY, short])
    assert [len(o.token_ids) for o in outs] == [6, 2]
    assert outs[0].text == outs[0].outputs[0].text and outs[0].finish_reason == "length"
    assert outs[0].token_ids == llm.generate([a], GREEDY)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="2 sampling params for 1 prompts"):
        llm.generate([a], [GREEDY, short])
    with pytest.raises(InvalidRequest, match="'prompt' or 'prompt_token_ids'"):
        llm.generate({"text": "hi"}, GREEDY)
    logged = llm.generate([a], SamplingParams(max_tokens=4, temperature=0, logprobs=2))[0]
    c = logged.outputs[0]
    total = sum(lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids, strict=True))
    assert math.isclose(c.cumulative_logprob, total) and c.cumulative_logprob < 0
    assert llm.generate([a], GREEDY)[0].outputs[0].cumulative_logprob is None


def test_chat_renders_the_template_and_generates_its_tokens(llm):
    conversation = [{"role": "user", "content": "What is 2 + 2?"}]
    [out] = llm.chat(conversation, GREEDY)
    rendered = llm.tokenizer.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=True
    )
    assert out.prompt == rendered and rendered.endswith("assistant\n")
    ids = llm.tokenizer.encode(rendered, add_special_tokens=False)
    assert out.prompt_token_ids == tuple(ids)
    assert out.outputs[0].token_ids == llm.generate([ids], GREEDY)[0].outputs[0].token_ids
    two = llm.chat([conversation, conversation + [{"role": "assistant", "content": "It is"}]],
                   GREEDY, continue_final_message=True, add_generation_prompt=False)  # fmt: skip
    assert two[1].prompt.endswith("It is") and not two[0].prompt.endswith("assistant\n")


def test_chat_passes_template_kwargs_and_tools_to_the_template(llm):
    template = (
        "{% if shout %}LOUD {% endif %}{% for t in tools or [] %}[{{ t.function.name }}]"
        "{% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {}}}]
    [out] = llm.chat([{"role": "user", "content": "hi"}], GREEDY, chat_template=template,
                     chat_template_kwargs={"shout": True}, tools=tools)  # fmt: skip
    assert out.prompt == "LOUD [weather]hi"
