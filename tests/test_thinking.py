"""The Thinking variants' layout (issue 46): ``rlt-hal toy-checkpoint --thinking`` writes
``<think>`` and ``</think>`` as tokens and a template whose ``enable_thinking`` (a request's
``chat_template_kwargs``) opens the reasoning block in the generation prompt."""

from __future__ import annotations

import json

import httpx
import pytest

from runtime_glue.cli.main import main as cli
from runtime_glue.engine.llm import LLM
from runtime_glue.engine.sampling import SamplingParams
from runtime_glue.ouro.toy import THINK_END, THINK_START
from runtime_glue.server.reasoning import PARSERS, ReasoningStream, reasoning_parser
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


# -- reasoning parsers -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,text,want",
    [
        ("deepseek_r1", "<think>\nsum it</think>\n4", ("\nsum it", "\n4")),
        ("deepseek_r1", "sum it</think>4", ("sum it", "4")),  # the template opened the block
        ("deepseek_r1", "sum it, still", ("sum it, still", None)),  # cut off while thinking
        ("deepseek_r1", "<think>x</think>", ("x", None)),
        ("qwen3", "<think>x</think>4", ("x", "4")),
        ("qwen3", "4, no block", (None, "4, no block")),
    ],
)
def test_a_whole_output_splits_into_reasoning_and_answer(name, text, want):
    assert PARSERS[name].split(text) == want


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_streamed_pieces_add_up_to_the_whole_split_whatever_the_cuts(name):
    """Every cut of the text into pieces, tags split anywhere: the deltas join to the split of
    the whole, and nothing sent is taken back."""
    text = "<think>a<b</think>c</thin d"
    parser = PARSERS[name]
    want = tuple(part or "" for part in parser.split(text))
    for cut in range(1, len(text)):
        for step in (1, 2, 3, 5):
            stream, got = ReasoningStream(parser), ["", ""]
            ends = list(range(cut, len(text), step)) + [len(text)]
            for end in ends:
                r, c = stream.advance(text[:end], end == len(text))
                got[0], got[1] = got[0] + r, got[1] + c
            assert tuple(got) == want, (cut, step)
    assert reasoning_parser(None) is None
    with pytest.raises(ValueError, match="unknown reasoning parser 'r1'"):
        reasoning_parser("r1")


# Generated text with a reasoning block: a grammar makes the random weights write words, the
# end tag (the checkpoint's token) and more words.
SHAPED = {"regex": "[a-z]{3,8} [a-z]{3,8}</think>[a-z]{2,6}"}


def test_the_server_splits_what_the_model_wrote_whole_streamed_or_left_out(thinking):
    plain = ServerProcess(thinking)
    parsed = ServerProcess(thinking, "--reasoning-parser", "deepseek_r1")
    body = {"model": "toy", "messages": CHAT, "max_tokens": 24, "temperature": 0,
            "structured_outputs": SHAPED, "chat_template_kwargs": {"enable_thinking": True}}  # fmt: skip
    try:
        ids = {"logprobs": True, "return_tokens_as_token_ids": True}
        raw = httpx.post(plain.base + "/v1/chat/completions", json={**body, **ids}, timeout=60)
        raw = raw.json()
        text = raw["choices"][0]["message"]["content"]
        assert THINK_END in text and "reasoning" not in raw["choices"][0]["message"]
        assert "completion_tokens_details" not in raw["usage"]  # no parser, no count
        reasoning, answer = text.split(THINK_END, 1)
        tokens = [t["token"] for t in raw["choices"][0]["logprobs"]["content"]]
        end = LLM(thinking, block_size=16, num_blocks=16).tokenizer.convert_tokens_to_ids(THINK_END)
        thought = tokens.index(f"token_id:{end}") + 1  # the reasoning's tokens, its tags too
        whole = httpx.post(parsed.base + "/v1/chat/completions", json=body, timeout=60).json()
        message = whole["choices"][0]["message"]
        assert message["reasoning"] == message["reasoning_content"] == reasoning
        assert message["content"] == answer
        assert whole["usage"]["completion_tokens_details"] == {"reasoning_tokens": thought}
        assert whole["usage"]["completion_tokens"] == len(tokens) > thought
        left_out = {**body, "include_reasoning": False}
        message = httpx.post(parsed.base + "/v1/chat/completions", json=left_out, timeout=60)
        message = message.json()["choices"][0]["message"]
        assert "reasoning" not in message and message["content"] == answer
        got = {"reasoning": "", "content": ""}
        order = []
        usage = None
        streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", parsed.base + "/v1/chat/completions",
                          json=streamed, timeout=60) as r:  # fmt: skip
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                for choice in chunk["choices"]:
                    for key in ("reasoning", "content"):
                        if choice["delta"].get(key):
                            got[key] += choice["delta"][key]
                            order.append(key)
        assert got == {"reasoning": reasoning, "content": answer}
        assert usage["completion_tokens_details"] == {"reasoning_tokens": thought}
        assert order.index("content") > max(i for i, k in enumerate(order) if k == "reasoning")
    finally:
        plain.stop()
        parsed.stop()
