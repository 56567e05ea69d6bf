"""Log-probabilities, echo, n and the sampling controls through a real server and the official
openai client: what the server returns equals what ``LLM.generate`` computes offline, bit for
bit (deterministic mode, the default on cpu), with speculation on and off."""

from __future__ import annotations

import httpx
import openai
import pytest

from runtime_glue.engine.llm import LLM
from runtime_glue.engine.sampling import SamplingParams
from tests.helpers import prompt_of
from tests.server_helpers import ServerProcess

PROMPT = prompt_of(12, seed=7)
SPECULATION = ("--speculative-loops", "1", "--num-speculative-tokens", "3")


@pytest.fixture(scope="module")
def spec_server(tiny_ckpt):
    proc = ServerProcess(tiny_ckpt, *SPECULATION)
    yield proc
    proc.stop()


@pytest.fixture(scope="module", params=["plain", "speculative"])
def any_server(request, server, spec_server):
    return server if request.param == "plain" else spec_server


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def local(tiny_ckpt):
    return LLM(tiny_ckpt, block_size=16, num_blocks=64)


def _chat_ids(local, messages) -> list[int]:
    text = local.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return local.tokenizer.encode(text, add_special_tokens=False)


def _legacy(tokens, rows, decode) -> dict:
    """OpenAI's legacy block of ``tokens`` as the engine's rows give it (text offsets aside)."""
    return {
        "tokens": [
            decode(t) if r is None else r[t].decoded_token
            for t, r in zip(tokens, rows, strict=True)
        ],
        "token_logprobs": [
            None if r is None else r[t].logprob for t, r in zip(tokens, rows, strict=True)
        ],
        "top_logprobs": [
            None if r is None else {lp.decoded_token: lp.logprob for lp in r.values()} for r in rows
        ],
    }


def _without_offsets(block: dict) -> dict:
    return {k: v for k, v in block.items() if k != "text_offset"}


SAMPLED = dict(max_tokens=10, temperature=0.8, seed=5, ignore_eos=True)


def test_completion_logprobs_equal_offline_bit_for_bit(any_server, local):
    want = local.generate([PROMPT], SamplingParams(**SAMPLED, logprobs=3))[0]
    got = _client(any_server).completions.create(
        model="toy", prompt=PROMPT, logprobs=3, max_tokens=10, temperature=0.8, seed=5,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    block = got.choices[0].logprobs.model_dump()
    assert _without_offsets(block) == _legacy(want.token_ids, want.logprobs, None)
    assert got.choices[0].text == want.text
    offsets = block["text_offset"]
    assert offsets[0] == 0 and all(
        b - a == len(t)
        for a, b, t in zip(offsets[:-1], offsets[1:], block["tokens"][:-1], strict=True)
    )


def test_chat_logprobs_equal_offline_bit_for_bit_streamed_or_not(any_server, local):
    messages = [{"role": "user", "content": "count with me"}]
    want = local.generate([_chat_ids(local, messages)], SamplingParams(**SAMPLED, logprobs=2))[0]
    kwargs = dict(
        model="toy", messages=messages, logprobs=True, top_logprobs=2, max_tokens=10,
        temperature=0.8, seed=5, extra_body={"ignore_eos": True},
    )  # fmt: skip
    client = _client(any_server)
    whole = client.chat.completions.create(**kwargs).choices[0].logprobs.content
    streamed = [
        entry
        for chunk in client.chat.completions.create(**kwargs, stream=True)
        if chunk.choices and chunk.choices[0].logprobs is not None
        for entry in chunk.choices[0].logprobs.content
    ]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in whole]
    assert len(whole) == 10
    for entry, token, row in zip(whole, want.token_ids, want.logprobs, strict=True):
        assert (entry.token, entry.logprob) == (row[token].decoded_token, row[token].logprob)
        assert entry.bytes == list(entry.token.encode())
        best = sorted((lp for lp in row.values() if lp.rank <= 2), key=lambda lp: lp.rank)
        assert [(t.token, t.logprob) for t in entry.top_logprobs] == [
            (lp.decoded_token, lp.logprob) for lp in best
        ]


def test_streamed_completion_logprobs_add_up_to_the_whole_response(server):
    client = _client(server)
    kwargs = dict(model="toy", prompt=PROMPT, logprobs=2, echo=True, **SAMPLED)
    kwargs["extra_body"] = {"ignore_eos": kwargs.pop("ignore_eos")}
    whole = client.completions.create(**kwargs).choices[0]
    joined: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    text = ""
    for chunk in client.completions.create(**kwargs, stream=True):
        text += chunk.choices[0].text
        for key, values in chunk.choices[0].logprobs.model_dump().items():
            joined[key] += values
    assert text == whole.text
    assert joined == whole.logprobs.model_dump()


def test_echo_scores_the_prompt_as_lm_eval_asks_with_max_tokens_one_or_zero(server, local):
    decode = lambda t: local.tokenizer.decode([t])  # noqa: E731 - the prompt's first token
    want = local.generate([PROMPT], SamplingParams(max_tokens=1, prompt_logprobs=1, logprobs=1))[0]
    client = _client(server)
    # lm-eval's loglikelihood request, as it sends it
    got = client.completions.create(
        model="toy", prompt=[PROMPT], max_tokens=1, logprobs=1, echo=True, temperature=0, seed=1234
    ).choices[0]
    prompt_text = local.tokenizer.decode(PROMPT)
    assert got.text == prompt_text + want.text
    block = got.logprobs.model_dump()
    rows = [*want.prompt_logprobs, *want.logprobs]
    assert _without_offsets(block) == _legacy([*PROMPT, *want.token_ids], rows, decode)
    assert block["token_logprobs"][0] is None and block["text_offset"][len(PROMPT)] == len(
        prompt_text
    )
    only = client.completions.create(
        model="toy", prompt=PROMPT, max_tokens=0, logprobs=1, echo=True
    ).choices[0]
    assert only.text == prompt_text and only.finish_reason == "length"
    cut = {k: v[: len(PROMPT)] for k, v in block.items()}
    assert only.logprobs.model_dump() == cut
    plain = client.completions.create(model="toy", prompt=PROMPT, max_tokens=0, echo=True)
    assert plain.choices[0].text == prompt_text and plain.choices[0].logprobs is None
    assert plain.usage.completion_tokens == 0


def test_prompt_logprobs_are_right_on_a_prefix_cache_hit(server, local, tiny_ckpt):
    prompt = prompt_of(40, seed=8)  # two full blocks of 16: cacheable
    fresh = LLM(tiny_ckpt, block_size=16, num_blocks=64)
    want = fresh.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=2))[0]
    body = {"model": "toy", "prompt": prompt, "max_tokens": 1, "temperature": 0}
    before = server.metrics()["rlt_hal_prefix_cache_hits_total"]
    for _ in range(2):  # the second: its prompt blocks are in the prefix cache now
        assert httpx.post(server.base + "/v1/completions", json=body).status_code == 200
    assert server.metrics()["rlt_hal_prefix_cache_hits_total"] >= before + 32
    for _ in range(2):
        got = httpx.post(
            server.base + "/v1/completions", json={**body, "prompt_logprobs": 2}
        ).json()["choices"][0]["prompt_logprobs"]
        assert got[0] is None and len(got) == len(prompt)
        for row, mine in zip(got[1:], want.prompt_logprobs[1:], strict=True):
            assert row == {
                str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
                for t, lp in mine.items()
            }


def test_n_choices_share_the_prompts_pages_and_each_equals_its_own_request(any_server, local):
    forked = any_server.metrics()["rlt_hal_forked_requests_total"]
    got = _client(any_server).completions.create(
        model="toy", prompt=PROMPT, n=3, logprobs=1, max_tokens=10, temperature=0.8, seed=5,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert any_server.metrics()["rlt_hal_forked_requests_total"] == forked + 2
    assert [c.index for c in got.choices] == [0, 1, 2]
    assert len({c.text for c in got.choices}) == 3
    for c in got.choices:
        params = SamplingParams(**{**SAMPLED, "seed": 5 + c.index}, logprobs=1)
        want = local.generate([PROMPT], params)[0]
        assert c.text == want.text
        assert _without_offsets(c.logprobs.model_dump()) == _legacy(
            want.token_ids, want.logprobs, None
        )


def _controls(plain) -> dict:
    """Each control, at a value that changes this prompt's tokens (chosen from them)."""
    first, second, fifth = plain.token_ids[0], plain.token_ids[1], plain.token_ids[4]
    return {
        "presence_penalty": 2.0,
        "frequency_penalty": 2.0,
        "repetition_penalty": 0.2,  # below 1: favours what was seen
        "logit_bias": {str(first): -100, str(second): 8},
        "min_p": 0.3,
        "stop_token_ids": [fifth],
        "min_tokens": 8,  # with stop_token_ids: past the stop id
    }


@pytest.mark.parametrize(
    "control",
    [
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "logit_bias",
        "min_p",
        "stop_token_ids",
        "min_tokens",
    ],
)
def test_each_sampling_control_round_trips_as_offline(server, local, control):
    # greedy, where a penalty changes the pick; min_p filters what sampling draws from
    base = dict(max_tokens=12, seed=3, temperature=1.5 if control == "min_p" else 0.0)
    plain = local.generate([PROMPT], SamplingParams(**base))[0]
    given = {control: _controls(plain)[control]}
    if control == "min_tokens":
        given["stop_token_ids"] = _controls(plain)["stop_token_ids"]
    offline = dict(given)
    if "logit_bias" in offline:
        offline["logit_bias"] = {int(k): v for k, v in offline["logit_bias"].items()}
    want = local.generate([PROMPT], SamplingParams(**base, **offline))[0]
    if control == "min_tokens":  # the control matters: without it, the stop id ends sooner
        stopped = dict(offline, min_tokens=0)
        assert local.generate([PROMPT], SamplingParams(**base, **stopped))[0].token_ids != (
            want.token_ids
        )
    else:
        assert want.token_ids != plain.token_ids  # the control matters here
    openai_fields = {
        k: v
        for k, v in given.items()
        if k in ("presence_penalty", "frequency_penalty", "logit_bias")
    }
    vllm_fields = {k: v for k, v in given.items() if k not in openai_fields}
    got = _client(server).completions.create(
        model="toy", prompt=PROMPT, **base, **openai_fields, extra_body=vllm_fields
    )
    assert got.choices[0].text == want.text and got.usage.completion_tokens == len(want.token_ids)


def test_the_controls_together_in_chat_as_offline(server, local):
    messages = [{"role": "user", "content": "hello there"}]
    ids = _chat_ids(local, messages)
    base = dict(max_tokens=12, seed=4, temperature=1.2)
    plain = local.generate([ids], SamplingParams(**base))[0]
    given = _controls(plain)
    bias = {int(k): v for k, v in given["logit_bias"].items()}
    want = local.generate([ids], SamplingParams(**base, **{**given, "logit_bias": bias}))[0]
    got = _client(server).chat.completions.create(
        model="toy", messages=messages, **base, presence_penalty=2.0, frequency_penalty=2.0,
        logit_bias=given["logit_bias"],
        extra_body={k: given[k] for k in ("repetition_penalty", "min_p", "stop_token_ids", "min_tokens")},  # noqa: E501
    )  # fmt: skip
    assert got.choices[0].message.content == want.text


@pytest.mark.parametrize(
    "field, value, param, message",
    [
        ("presence_penalty", 2.5, "presence_penalty", "less than or equal to 2"),
        ("frequency_penalty", -3, "frequency_penalty", "greater than or equal to -2"),
        ("repetition_penalty", 0, "repetition_penalty", "greater than 0"),
        ("logit_bias", {"x": 1}, "logit_bias", "keys must be token ids"),
        ("logit_bias", {"3": 101}, "logit_bias", "must be in [-100, 100]"),
        ("logit_bias", {"99999": 1}, "logit_bias", "outside the vocabulary"),
        ("stop_token_ids", [5000], "stop_token_ids", "outside the vocabulary"),
        ("min_p", 1.5, "min_p", "less than or equal to 1"),
        ("min_tokens", 9, "min_tokens", "min_tokens must be in [0, max_tokens (4)]"),
        ("logprobs", 21, "logprobs", "less than or equal to 20"),
        ("prompt_logprobs", -1, "prompt_logprobs", "greater than or equal to 0"),
        ("max_tokens", 0, "max_tokens", "0 only with echo or prompt_logprobs"),
    ],
)
def test_out_of_range_controls_are_a_400_naming_the_field(server, field, value, param, message):
    body = {"model": "toy", "prompt": "hello", "max_tokens": 4, field: value}
    r = httpx.post(server.base + "/v1/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and message in err["message"], err


def test_top_logprobs_need_logprobs_in_chat(server):
    body = {"model": "toy", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}
    err = httpx.post(server.base + "/v1/chat/completions", json=body).json()["error"]
    assert err["param"] == "top_logprobs" and "needs logprobs=true" in err["message"]
