"""The Thinking variants' layout (issue 46): ``rlt-hal toy-checkpoint --thinking`` writes
``<think>`` and ``</think>`` as tokens and a template whose ``enable_thinking`` (a request's
``chat_template_kwargs``) opens the reasoning block in the generation prompt."""

from __future__ import annotations

import httpx
import pytest

from runtime_glue.cli.main import main as cli
from runtime_glue.engine.llm import LLM
from runtime_glue.engine.sampling import SamplingParams
from runtime_glue.ouro.toy import THINK_END, THINK_START
from tests.server_helpers import ServerProcess

CHAT = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture(scope="module")
def thinking(tmp_path_factory):
    out = tmp_path_factory.mktemp("thinking") / "ckpt"
    assert cli(["toy-checkpoint", str(out), "--thinking"]) == 0
    return out


def test_the_think_tags_are_tokens_the_model_can_write_and_the_text_keeps(thinking):
    llm = LLM(thinking, block_size=16, num_blocks=16)
    tok = llm.tokenizer
    start, end = tok.convert_tokens_to_ids([THINK_START, THINK_END])
    assert (start, end) == (1022, 1023) and end < llm.config.vocab_size
    assert tok.encode(f"{THINK_START}\nx{THINK_END}", add_special_tokens=False)[0] == start
    assert tok.decode([start, end], skip_special_tokens=True) == THINK_START + THINK_END
    # generated, not only encoded: a bias that makes the end tag the greedy choice
    [out] = llm.generate([[5, 9, 12]], SamplingParams(max_tokens=2, logit_bias={end: 100.0}))
    assert list(out.outputs[0].token_ids) == [end, end]
    assert out.outputs[0].text == THINK_END * 2


def test_enable_thinking_opens_the_block_through_chat_template_kwargs(thinking):
    server = ServerProcess(thinking)
    try:

        def ids(**extra):
            body = {"model": "toy", "messages": CHAT, **extra}
            return httpx.post(server.base + "/tokenize", json=body, timeout=60).json()["tokens"]

        plain, opened = ids(), ids(chat_template_kwargs={"enable_thinking": True})
        assert opened[: len(plain)] == plain and len(opened) > len(plain)
        start = LLM(thinking, block_size=16, num_blocks=16).tokenizer.convert_tokens_to_ids(
            THINK_START
        )
        assert start in opened[len(plain) :] and start not in plain
        body = {"model": "toy", "messages": CHAT, "max_tokens": 2,
                "chat_template_kwargs": {"enable_thinking": True}}  # fmt: skip
        r = httpx.post(server.base + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(opened)
    finally:
        server.stop()


def test_the_trained_preset_has_no_thinking_layout(tmp_path, capsys):
    assert cli(["toy-checkpoint", str(tmp_path / "t"), "--preset", "trained", "--thinking"]) == 2
    assert "learned no reasoning format" in capsys.readouterr().err
