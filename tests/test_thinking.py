"""The Thinking variants' layout (issue 46): ``rlt-hal toy-checkpoint --thinking`` writes
``<think>`` and ``</think>`` as tokens and a template whose ``enable_thinking`` (a request's
``chat_template_kwargs``) opens the reasoning block in the generation prompt."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from runtime_glue.cli.main import main as cli
from runtime_glue.engine.core import InvalidRequest
from runtime_glue.engine.llm import LLM
from runtime_glue.engine.reasoning import (
    ANSWER,
    PARSERS,
    THINKING,
    UNDECIDED,
    ReasoningMatcher,
    ReasoningStream,
    ThinkingTags,
    reasoning_parser,
)
from runtime_glue.engine.sampling import SamplingParams
from runtime_glue.ouro.toy import THINK_END, THINK_START
from tests.server_helpers import ServerProcess

CHAT = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture(scope="module")
def thinking(tmp_path_factory):
    out = tmp_path_factory.mktemp("thinking") / "ckpt"
    assert cli(["toy-checkpoint", str(out), "--thinking"]) == 0
    return out


@pytest.fixture(scope="module")
def r1(thinking):
    """The Thinking-layout toy with deepseek_r1's parser, deterministic (speculation exact)."""
    return LLM(thinking, block_size=16, num_blocks=64, deterministic=True,
               reasoning_parser="deepseek_r1")  # fmt: skip


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


# Generated text with a reasoning block: a budget of 6 ends the random weights' reasoning with
# the end tag (the checkpoint's token), then a grammar makes them write a word.
ANSWER_WORD = "[a-z]{2,6}"
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"enum": [1, 2]}, "b": {"enum": [2, 3]}},
    "required": ["a", "b"], "additionalProperties": False}}}]  # fmt: skip


def _post(server, body) -> httpx.Response:
    return httpx.post(server.base + "/v1/chat/completions", json=body, timeout=60)


def test_the_server_splits_what_the_model_wrote_whole_streamed_or_left_out(thinking):
    plain = ServerProcess(thinking)
    parsed = ServerProcess(thinking, "--reasoning-parser", "deepseek_r1")
    body = {"model": "toy", "messages": CHAT, "max_tokens": 24, "temperature": 0,
            "thinking_token_budget": 6, "structured_outputs": {"regex": ANSWER_WORD},
            "chat_template_kwargs": {"enable_thinking": True}}  # fmt: skip
    try:
        refused = _post(plain, body)  # a budget needs a parser
        assert refused.status_code == 400
        assert refused.json()["error"]["param"] == "thinking_token_budget"
        tok = LLM(thinking, block_size=16, num_blocks=16).tokenizer
        end = tok.convert_tokens_to_ids(THINK_END)
        shaped = {k: v for k, v in body.items() if k not in ("thinking_token_budget",
                  "structured_outputs")} | {"max_tokens": 3, "logit_bias": {str(end): 100}}  # fmt: skip
        raw = _post(plain, shaped).json()  # no parser: one content, tags and all, no count
        assert THINK_END in raw["choices"][0]["message"]["content"]
        assert "reasoning" not in raw["choices"][0]["message"]
        assert "completion_tokens_details" not in raw["usage"]

        ids = {"logprobs": True, "return_tokens_as_token_ids": True}
        whole = _post(parsed, {**body, **ids}).json()
        message = whole["choices"][0]["message"]
        tokens = [int(t["token"][9:]) for t in whole["choices"][0]["logprobs"]["content"]]
        assert tokens.index(end) == 6  # the budget's reasoning tokens, then the tag forced
        reasoning = tok.decode(tokens[:6])
        assert message["reasoning"] == message["reasoning_content"] == reasoning
        answer = message["content"]
        assert re.fullmatch(ANSWER_WORD, answer) and tok.decode(tokens[7:]) == answer
        assert whole["usage"]["completion_tokens_details"] == {"reasoning_tokens": 7}
        assert whole["usage"]["completion_tokens"] == len(tokens) > 7
        left_out = _post(parsed, {**body, "include_reasoning": False}).json()
        message = left_out["choices"][0]["message"]
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
        assert usage["completion_tokens_details"] == {"reasoning_tokens": 7}
        assert order.index("content") > max(i for i, k in enumerate(order) if k == "reasoning")

        # the openai SDK reads both, whole and streamed (vLLM's extra fields on its models)
        client = openai.OpenAI(base_url=parsed.base + "/v1", api_key="unused")
        sdk_body = {k: v for k, v in body.items() if k not in ("model", "messages", "max_tokens")}
        sdk = client.chat.completions.create(model="toy", messages=CHAT, max_tokens=24,
                                             extra_body=sdk_body)  # fmt: skip
        assert (sdk.choices[0].message.reasoning, sdk.choices[0].message.content) == (
            reasoning,
            answer,
        )
        assert sdk.usage.completion_tokens_details.reasoning_tokens == 7
        parts = {"reasoning": "", "content": ""}
        for chunk in client.chat.completions.create(
            model="toy", messages=CHAT, max_tokens=24, stream=True, extra_body=sdk_body
        ):
            delta = chunk.choices[0].delta
            parts["reasoning"] += getattr(delta, "reasoning", None) or ""
            parts["content"] += delta.content or ""
        assert parts == {"reasoning": reasoning, "content": answer}

        # reasoning_effort as a budget: "none" ends the block at once; unknown efforts refused
        effort = {k: v for k, v in body.items() if k != "thinking_token_budget"}
        none = _post(parsed, {**effort, **ids, "reasoning_effort": "none"}).json()
        first = none["choices"][0]["logprobs"]["content"][0]["token"]
        assert first == f"token_id:{end}" and none["choices"][0]["message"]["reasoning"] is None
        bad = _post(parsed, {**effort, "reasoning_effort": "extreme"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "reasoning_effort"
        assert _post(plain, {**effort, "reasoning_effort": "extreme"}).status_code == 200

        # a tool call after the thinking, parsed from the answer only
        call = {**body, "tools": TOOLS, "tool_choice": "required", "max_tokens": 48}
        del call["structured_outputs"]
        out = _post(parsed, call).json()["choices"][0]
        assert out["finish_reason"] == "tool_calls" and out["message"]["reasoning"]
        (tool_call,) = out["message"]["tool_calls"]
        assert tool_call["function"]["name"] == "add"
        args = json.loads(tool_call["function"]["arguments"])
        assert args["a"] in (1, 2) and args["b"] in (2, 3)
    finally:
        plain.stop()
        parsed.stop()


def test_a_schema_answer_after_free_reasoning_is_the_same_with_speculation(thinking):
    """The issue's check on the server: a json_schema request with a reasoning parser gives
    free reasoning and schema-valid JSON, and the same bits with drafts from the first loops
    (deterministic mode, the cpu's default)."""
    plain = ServerProcess(thinking, "--reasoning-parser", "deepseek_r1")
    spec = ServerProcess(thinking, "--reasoning-parser", "deepseek_r1", "--speculative-loops", "2")
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    body = {"model": "toy", "messages": CHAT, "max_tokens": 64, "temperature": 0,
            "response_format": fmt, "thinking_token_budget": 8,
            "chat_template_kwargs": {"enable_thinking": True}, "logprobs": True}  # fmt: skip
    try:
        got = [_post(server, body).json()["choices"][0] for server in (plain, spec)]
        assert got[0] == got[1]
        message = got[0]["message"]
        assert message["reasoning"] and got[0]["finish_reason"] == "stop"
        jsonschema.validate(json.loads(message["content"]), SCHEMA)
        metrics = httpx.get(spec.base + "/metrics").text
        verified = re.search(r"^rlt_hal_spec_verify_steps_total (\S+)$", metrics, re.M)
        assert verified and float(verified.group(1)) > 0  # drafts were verified
    finally:
        plain.stop()
        spec.stop()


# -- the engine: grammars after the reasoning, thinking budgets ------------------------------

SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": [3, 4, 5]}, "why": {"type": "string", "maxLength": 8}},
    "required": ["answer", "why"],
    "additionalProperties": False,
}
OPENED = {"enable_thinking": True}
JSON = {"json": SCHEMA, "disable_any_whitespace": True}


def _tags(llm) -> tuple[int, int]:
    return tuple(llm.tokenizer.convert_tokens_to_ids([THINK_START, THINK_END]))


def _json_after_thinking(budget: int, **extra) -> SamplingParams:
    return SamplingParams(max_tokens=64, structured_outputs=JSON,
                          thinking_token_budget=budget, **extra)  # fmt: skip


def test_a_schema_answer_follows_free_reasoning_that_the_budget_ends(r1):
    start, end = _tags(r1)
    [out] = r1.chat(CHAT, _json_after_thinking(5), chat_template_kwargs=OPENED)
    got = out.outputs[0]
    tokens = list(got.token_ids)
    assert tokens.index(end) == 5 and got.finish_reason == "stop"  # 5 tokens, then forced
    assert got.reasoning == r1.tokenizer.decode(tokens[:5])
    jsonschema.validate(json.loads(got.content), SCHEMA)
    assert got.text == got.reasoning + THINK_END + got.content
    # the reasoning is the model's own: the grammar would never have allowed its first token
    compiler = r1.engine.grammar_compiler()
    assert not compiler.matcher(compiler.compile(_spec(r1))).accept(tokens[0])
    # without the parser the grammar holds from the first token and nothing is reasoning
    plain = LLM(r1.model_dir, block_size=16, num_blocks=64, deterministic=True)
    params = SamplingParams(max_tokens=64, structured_outputs=JSON)
    [flat] = plain.chat(CHAT, params, chat_template_kwargs=OPENED)
    assert end not in flat.outputs[0].token_ids and flat.outputs[0].reasoning is None
    jsonschema.validate(json.loads(flat.outputs[0].content), SCHEMA)


@pytest.mark.parametrize("mode", ["hf-exact", "fast"])
def test_the_grammar_starts_after_the_reasoning_in_every_mode(thinking, mode):
    llm = LLM(thinking, block_size=16, num_blocks=64, mode=mode, reasoning_parser="deepseek_r1")
    [out] = llm.chat(CHAT, _json_after_thinking(4), chat_template_kwargs=OPENED)
    got = out.outputs[0]
    assert list(got.token_ids).index(_tags(llm)[1]) == 4 and got.finish_reason == "stop"
    jsonschema.validate(json.loads(got.content), SCHEMA)


def _spec(llm):
    from runtime_glue.engine.structured import parse_structured

    return parse_structured(JSON)


@pytest.mark.parametrize("budget", [0, 1, 3])
def test_the_budget_forces_the_end_tag_whether_or_not_the_model_opened_the_block(thinking, budget):
    """deepseek_r1 with a prompt that opened nothing: the output thinks from its first token;
    a block the model opens itself (a bias makes it) is bounded the same way, its opening tag
    not charged, under either parser. Once the answer begins the request is masked no more."""
    for name, opens in (("deepseek_r1", False), ("deepseek_r1", True), ("qwen3", True)):
        llm = LLM(thinking, block_size=16, num_blocks=32, reasoning_parser=name)
        start, end = _tags(llm)
        logit_bias = {start: 100.0} if opens else {}
        params = SamplingParams(max_tokens=12, thinking_token_budget=budget,
                                logit_bias=logit_bias, ignore_eos=True)  # fmt: skip
        [out] = llm.chat(CHAT, params)
        tokens = list(out.outputs[0].token_ids)
        lead = int(tokens[0] == start)  # (unbiased, the model may open it too)
        assert lead >= opens and tokens.index(end) == lead + budget, (name, tokens)
        # the engine drops the reasoning's mask after the end tag (the fast path again)
        engine, ids = llm.engine, llm.tokenizer.encode("hi", add_special_tokens=False)
        engine.add_request("r", ids, params)
        req = engine.requests["r"]
        while end not in req.output_ids:
            assert req.matcher is not None
            engine.step()
        assert req.matcher is None
        engine.abort_request("r")


def test_a_prompt_that_closed_the_block_leaves_everything_to_the_answer(thinking):
    llm = LLM(thinking, block_size=16, num_blocks=32, reasoning_parser="deepseek_r1")
    tok, parser = llm.tokenizer, llm.reasoning
    assert parser.prompt_opens(tok.decode, tok.encode("hi<|im_start|>assistant\n<think>\n")) is True
    assert parser.prompt_opens(tok.decode, tok.encode("a<think>\n\n</think>\n\n")) is False
    assert parser.prompt_opens(tok.decode, tok.encode("<|im_start|>assistant\n")) is None
    closed = "{% for m in messages %}{{ m['content'] }}{% endfor %}<think>\n\n</think>\n\n"
    params = SamplingParams(max_tokens=24, structured_outputs=JSON,
                            thinking_token_budget=2)  # fmt: skip
    [out] = llm.chat(CHAT, params, chat_template=closed)
    got = out.outputs[0]
    assert got.reasoning is None and _tags(llm)[1] not in got.token_ids  # no budget spent
    jsonschema.validate(json.loads(got.content), SCHEMA)


def test_a_draft_that_crosses_the_end_tag_is_masked_by_the_right_state(r1):
    """The masks after tokens taken ahead (a speculative verify's) equal those of accepting
    them one by one, across the end tag and back (rollback)."""
    start, end = _tags(r1)
    compiler = r1.engine.grammar_compiler()
    tags = ThinkingTags.of(r1.reasoning, r1.tokenizer)
    assert tags == ThinkingTags(r1.reasoning, start, end)
    vocab = r1.config.vocab_size

    def fresh():
        inner = compiler.matcher(compiler.compile(_spec(r1)))
        return ReasoningMatcher(tags, THINKING, vocab, (0, 2), inner, budget=2)

    brace = r1.tokenizer.encode("{", add_special_tokens=False)
    drafts = [7, 9, end, *brace]
    ahead = fresh()
    masks, n = ahead.draft_masks(drafts)
    assert n == len(drafts) and ahead.num_accepted == 0 and ahead.phase == THINKING
    one = fresh()
    for i, token in enumerate(drafts):
        assert bool((masks[i] == one.allowed()).all()), i
        assert one.accept(token)
    assert bool((masks[-1] == one.allowed()).all()) and one.phase == ANSWER
    assert masks[2].sum() == 1 and masks[2][end]  # the budget spent: the end tag alone
    assert not masks[1][0] and masks[1][5]  # thinking: anything but EOS while a grammar waits
    assert not masks[3][7]  # the answer's first token: the grammar's ("{" only)
    one.rollback(2)
    assert one.phase == THINKING and one.thought == 2 and not one.accept(5)  # forced again
    # qwen3's undecided start: the grammar's tokens or the opening tag, which is not charged
    undecided = ReasoningMatcher(tags, UNDECIDED, vocab, (0, 2),
                                 compiler.matcher(compiler.compile(_spec(r1))), budget=1)  # fmt: skip
    first = undecided.allowed()
    assert first[start] and first[brace[0]] and not first[7] and not first[0]
    masks, n = undecided.draft_masks([start, 7, end, *brace])
    assert n == 4 and undecided.phase == UNDECIDED and undecided.num_accepted == 0
    assert not masks[1].all() and masks[1][7] and not masks[1][0]  # thinking
    assert masks[2].sum() == 1 and masks[2][end]  # one token of budget spent
    assert undecided.accept(start) and undecided.accept(7) and undecided.phase == THINKING
    undecided.rollback(2)  # back across the opening tag
    assert undecided.phase == UNDECIDED and undecided.thought == 0
    assert undecided.accept(brace[0]) and undecided.phase == ANSWER
    assert not undecided.accept(start)  # the answer's grammar refuses a late tag


def test_speculation_and_replayed_graphs_give_the_same_reasoning_and_answer(r1, thinking):
    params = _json_after_thinking(6)
    [want] = r1.chat(CHAT, params, chat_template_kwargs=OPENED)
    spec = r1.with_speculation(2, tokens=4)
    [got] = spec.chat(CHAT, params, chat_template_kwargs=OPENED)
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert spec.engine.stats["spec_verify_steps"] > 0
    jsonschema.validate(json.loads(got.outputs[0].content), SCHEMA)
    runs = {}
    for graphs in (False, True):  # the emulated npu (a CPU test double), graphs replayed or not
        npu = LLM(thinking, device="npu", block_size=16, num_blocks=32 + graphs,
                  deterministic=True, step_graphs=graphs, reasoning_parser="deepseek_r1")  # fmt: skip
        [out] = npu.chat(CHAT, params, chat_template_kwargs=OPENED)
        runs[graphs] = out.outputs[0]
        if graphs:
            assert npu.engine.graphs is not None and npu.engine.graphs.stats["graph_steps"] > 0
    assert runs[True].token_ids == runs[False].token_ids
    assert runs[True].content == runs[False].content and runs[True].reasoning is not None


def test_budgets_and_tags_are_refused_where_they_cannot_hold(r1, tiny_ckpt):
    plain = LLM(r1.model_dir, block_size=16, num_blocks=16)
    with pytest.raises(InvalidRequest, match="needs a reasoning parser") as exc:
        plain.generate([[5, 6]], SamplingParams(thinking_token_budget=3))
    assert exc.value.param == "thinking_token_budget"
    with pytest.raises(ValueError, match="thinking_token_budget must be >= 0"):
        SamplingParams(thinking_token_budget=-1)
    no_tags = LLM(tiny_ckpt, block_size=16, num_blocks=16, reasoning_parser="deepseek_r1")
    with pytest.raises(InvalidRequest, match="'<think>' is 5 tokens of this tokenizer, not one"):
        no_tags.generate([[5, 6]], SamplingParams(thinking_token_budget=3))
    # tags that are not single tokens: a grammar runs from the first token, as without a parser
    params = SamplingParams(max_tokens=64, structured_outputs=JSON)
    [shaped] = no_tags.generate([[5, 6]], params)
    jsonschema.validate(json.loads(shaped.outputs[0].text), SCHEMA)
    # a parser alone masks nothing for a request without a grammar or budget
    r1.engine.add_request("free", [5, 6], SamplingParams(max_tokens=2))
    assert r1.engine.requests["free"].matcher is None
    r1.engine.abort_request("free")


def test_a_token_the_grammar_engine_allows_then_refuses_ends_the_output_with_an_error(thinking):
    """llguidance 1.9 marks the checkpoint's added tags as special tokens; a grammar whose text
    spells one allows that token in its mask and then refuses to consume it. The engine must
    not go on with a matcher left behind (it looped, writing the tag until max_tokens): the
    output ends there, failed. A grammar engine that consumes the tag gives a match instead."""
    llm = LLM(thinking, block_size=16, num_blocks=16)
    end = _tags(llm)[1]
    pattern = f"[a-z]{{3}} {THINK_END}[a-z]{{2,6}}"
    params = SamplingParams(max_tokens=16, structured_outputs={"regex": pattern},
                            logit_bias={end: 50.0})  # fmt: skip
    llm.engine.add_request("g", [5, 9], params)
    req = llm.engine.requests["g"]
    while llm.engine.has_unfinished():
        llm.engine.step()
    if req.finish_reason == "error":
        assert "refused token" in req.error and req.output_ids.count(end) == 0
    else:
        assert re.fullmatch(pattern, req.text) and req.finish_reason == "stop"


# -- the server's reasoning with tools, streams and efforts ----------------------------------


@pytest.fixture(scope="module")
def r1_server(thinking):
    """The Thinking-layout toy served with deepseek_r1's parser."""
    proc = ServerProcess(thinking, "--reasoning-parser", "deepseek_r1")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def hermes_r1(tiny_ckpt, tmp_path_factory):
    """The tiny toy with a template that renders tools (tool_choice 'auto' parses Hermes
    blocks) and deepseek_r1's parser. Its tags are text, not tokens, so a regex can make the
    model write the whole output, reasoning block included."""
    from tests.helpers import with_tool_template

    ckpt = with_tool_template(tiny_ckpt, tmp_path_factory.mktemp("hermes-r1"))
    proc = ServerProcess(ckpt, "--reasoning-parser", "deepseek_r1")
    yield proc
    proc.stop()


def _chunks(server, body) -> list[dict]:
    """A streamed chat completion's chunks (the data lines before [DONE])."""
    chunks = []
    with httpx.stream("POST", server.base + "/v1/chat/completions", json={**body, "stream": True},
                      timeout=60) as r:  # fmt: skip
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
    return chunks


WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]  # fmt: skip


def _hermes(city: str) -> str:
    return f'<tool_call>{{"name": "get_weather", "arguments": {{"city": "{city}"}}}}</tool_call>'


def test_a_call_written_in_the_reasoning_is_not_a_tool_call_only_the_answers_is(hermes_r1):
    """The model is made to write a Hermes call block inside its reasoning and another after
    it (a regex over the whole output): only the answer's becomes a call, whole and streamed;
    the reasoning keeps its block as text."""
    thought = f"maybe {_hermes('Paris')} no"
    said = f"{thought}</think>ok {_hermes('Oslo')}"
    body = {"model": "toy", "messages": [{"role": "user", "content": "weather?"}],
            "temperature": 0, "max_tokens": 200, "tools": WEATHER,
            "structured_outputs": {"regex": re.escape(said)}}  # fmt: skip
    out = _post(hermes_r1, body).json()["choices"][0]
    message = out["message"]
    assert message["reasoning"] == thought and message["content"] == "ok "
    (call,) = message["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Oslo"}
    assert out["finish_reason"] == "tool_calls"

    got: dict[str, str] = {"reasoning": "", "content": ""}
    calls = []
    for chunk in _chunks(hermes_r1, body):
        delta = chunk["choices"][0]["delta"]
        for key in got:
            got[key] += delta.get(key) or ""
        calls += delta.get("tool_calls") or []
    assert got == {"reasoning": thought, "content": "ok "}
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Oslo"}]


def test_a_required_call_after_the_thinking_streams_the_reasoning_then_the_call(r1_server):
    body = {"model": "toy", "messages": CHAT, "max_tokens": 48, "temperature": 0,
            "thinking_token_budget": 6, "chat_template_kwargs": {"enable_thinking": True},
            "tools": TOOLS, "tool_choice": "required"}  # fmt: skip
    whole = _post(r1_server, body).json()["choices"][0]
    (want,) = whole["message"]["tool_calls"]
    assert whole["message"]["reasoning"] and whole["message"]["content"] is None
    order, reasoning, calls, reasons = [], "", [], []
    for chunk in _chunks(r1_server, body):
        (choice,) = chunk["choices"]
        delta = choice["delta"]
        assert not delta.get("content")  # a forced call writes no message
        if delta.get("reasoning"):
            reasoning += delta["reasoning"]
            order.append("reasoning")
        if delta.get("tool_calls"):
            calls += delta["tool_calls"]
            order.append("tool_calls")
        reasons.append(choice["finish_reason"])
    assert order.count("tool_calls") == 1 and order[-1] == "tool_calls" and order[0] == "reasoning"
    assert reasoning == whole["message"]["reasoning"]
    (call,) = calls
    assert call["index"] == 0 and call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"]["name"] == "add"
    args = json.loads(call["function"]["arguments"])
    assert args == json.loads(want["function"]["arguments"])
    jsonschema.validate(args, TOOLS[0]["function"]["parameters"])
    assert reasons[-1] == "tool_calls" and set(reasons[:-1]) == {None}


def test_include_reasoning_false_leaves_the_reasoning_out_of_every_chunk(r1_server):
    body = {"model": "toy", "messages": CHAT, "max_tokens": 24, "temperature": 0,
            "thinking_token_budget": 6, "structured_outputs": {"regex": ANSWER_WORD},
            "chat_template_kwargs": {"enable_thinking": True}, "include_reasoning": False,
            "stream_options": {"include_usage": True}}  # fmt: skip
    shown = {k: v for k, v in body.items() if k not in ("include_reasoning", "stream_options")}
    thought = _post(r1_server, shown).json()["choices"][0]["message"]
    assert thought["reasoning"] and thought["content"]  # there is reasoning to leave out
    whole = _post(r1_server, {k: v for k, v in body.items() if k != "stream_options"}).json()
    message = whole["choices"][0]["message"]
    assert message["content"] == thought["content"] and "reasoning" not in message
    chunks = _chunks(r1_server, body)
    content = ""
    for chunk in chunks:
        for choice in chunk["choices"]:
            assert not {"reasoning", "reasoning_content"} & set(choice["delta"]), chunk
            content += choice["delta"].get("content") or ""
    assert content == message["content"]
    assert thought["reasoning"] not in content
    # left out of the text, still counted (vLLM's usage)
    assert chunks[-1]["usage"]["completion_tokens_details"] == {"reasoning_tokens": 7}


def test_reasoning_efforts_map_to_their_budgets_and_the_server_applies_them(r1):
    from runtime_glue.engine.reasoning import EFFORT_BUDGETS, effort_budget
    from runtime_glue.server.app import Server
    from runtime_glue.server.protocol import ChatCompletionRequest

    want = {"none": 0, "minimal": 128, "low": 512, "medium": 2048, "high": None, "xhigh": None}
    assert want == EFFORT_BUDGETS and all(effort_budget(e) == b for e, b in want.items())
    server = Server(r1, "toy")  # not started: its request preparation alone
    for effort, budget in want.items():
        body = ChatCompletionRequest(model="toy", messages=CHAT, reasoning_effort=effort)
        params = server._thinking_budget(body, SamplingParams(max_tokens=8))
        assert params.thinking_token_budget == budget, effort
    # a request's own budget wins over its effort
    body = ChatCompletionRequest(model="toy", messages=CHAT, reasoning_effort="minimal")
    given = SamplingParams(max_tokens=8, thinking_token_budget=3)
    assert server._thinking_budget(body, given).thinking_token_budget == 3


def test_reasoning_effort_minimal_ends_a_longer_reasoning_at_128_tokens(r1_server, thinking):
    """A bias keeps the random weights from ending the block themselves: without a budget
    they think past 128 tokens; with reasoning_effort 'minimal' the end tag comes at 128."""
    end = LLM(thinking, block_size=16, num_blocks=16).tokenizer.convert_tokens_to_ids(THINK_END)
    body = {"model": "toy", "messages": CHAT, "max_tokens": 140, "temperature": 0,
            "logit_bias": {str(end): -100}, "structured_outputs": {"regex": ANSWER_WORD},
            "chat_template_kwargs": {"enable_thinking": True}, "logprobs": True,
            "return_tokens_as_token_ids": True}  # fmt: skip

    def tokens(**extra) -> tuple[list[int], dict]:
        out = _post(r1_server, {**body, **extra}).json()
        choice = out["choices"][0]
        return [int(t["token"][9:]) for t in choice["logprobs"]["content"]], out

    free, out = tokens()
    assert end not in free and out["choices"][0]["finish_reason"] == "length"
    cut, out = tokens(reasoning_effort="minimal")
    assert cut.index(end) == 128 and cut[:128] == free[:128]
    assert out["usage"]["completion_tokens_details"] == {"reasoning_tokens": 129}
    assert re.fullmatch(ANSWER_WORD, out["choices"][0]["message"]["content"])
