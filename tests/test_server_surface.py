"""The OpenAI surface real clients use: chat shapes, usage in every chunk, several choices per
request, batched prompts and vLLM's tokenizer endpoints, through a real server and the official
openai client (one server for the module)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from runtime_glue.engine.llm import LLM
from runtime_glue.engine.sampling import SamplingParams

NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def local(tiny_ckpt):
    return LLM(tiny_ckpt, block_size=16, num_blocks=64)


def _greedy(local, prompt, n=6) -> str:
    return local.generate([prompt], SamplingParams(max_tokens=n, ignore_eos=True))[0].text


def _chat_ids(local, messages) -> list[int]:
    text = local.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return local.tokenizer.encode(text, add_special_tokens=False)


def _post(server, path, body):
    return httpx.post(server.base + path, json=body, timeout=60)


def _error(response, status=400) -> dict:
    assert response.status_code == status, response.text
    err = response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


# -- chat shapes ------------------------------------------------------------------------------


def test_text_parts_are_joined_by_newlines_as_vllm_joins_them(client, local):
    parts = [{"type": "text", "text": "first part"}, {"type": "text", "text": "second"}]
    got = client.chat.completions.create(
        model="toy",
        messages=[{"role": "user", "content": parts}],
        max_tokens=6,
        temperature=0,
        extra_body=NO_EOS,
    )
    ids = _chat_ids(local, [{"role": "user", "content": "first part\nsecond"}])
    assert got.choices[0].message.content == _greedy(local, ids)
    assert got.usage.prompt_tokens == len(ids)


def test_developer_is_system_and_tool_turns_reach_the_template(client, local):
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [
        {"role": "developer", "content": "be brief", "name": "ops"},
        {"role": "user", "content": "what is f?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "42"},
    ]
    got = client.chat.completions.create(
        model="toy", messages=messages, max_tokens=6, temperature=0, extra_body=NO_EOS
    )
    seen = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "what is f?"},
        {"role": "assistant", "content": ""},
        {"role": "tool", "content": "42"},
    ]  # what the toy's ChatML template reads of them
    ids = _chat_ids(local, seen)
    assert got.choices[0].message.content == _greedy(local, ids)
    assert got.usage.prompt_tokens == len(ids)


def test_the_template_gets_roles_names_and_tool_calls_in_the_hf_convention():
    from runtime_glue.server.messages import ChatMessage, template_messages

    raw = [
        {"role": "developer", "content": [{"type": "text", "text": "a"}], "name": "ops"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c", "content": "2"},
    ]
    assert template_messages([ChatMessage(**m) for m in raw]) == [
        {"role": "system", "content": "a", "name": "ops"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}
            ],
        },
        {"role": "tool", "content": "2", "tool_call_id": "c"},
    ]


IMAGE = {"type": "image_url", "image_url": {"url": "data:,"}}
CALL = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{"}}


@pytest.mark.parametrize(
    "message, param, text",
    [
        ({"role": "user", "content": [IMAGE]}, "messages[0].content[0].type", "'image_url'"),
        (
            {"role": "user", "content": [{"type": "text", "text": "a", "cache": 1}]},
            "messages[0].content[0].cache",
            "unknown field",
        ),
        ({"role": "user", "content": "a", "mood": "x"}, "messages[0].mood", "unknown field"),
        ({"role": "tool", "content": "a"}, "messages[0].tool_call_id", "needs the tool_call_id"),
        ({"role": "user", "content": None}, "messages[0].content", "needs content"),
        (
            {"role": "user", "content": "a", "tool_calls": [CALL]},
            "messages[0].tool_calls",
            "only assistant",
        ),
        (
            {"role": "assistant", "content": None, "tool_calls": [CALL]},
            "messages[0].tool_calls[0].function.arguments",
            "not valid JSON",
        ),
        ({"role": "robot", "content": "a"}, "messages[0].role", "'developer'"),
    ],
)
def test_chat_messages_the_server_cannot_render_are_a_400_naming_the_field(
    server, message, param, text
):
    body = {"model": "toy", "messages": [message], "max_tokens": 2}
    err = _error(_post(server, "/v1/chat/completions", body))
    assert err["param"] == param and text in err["message"]


# -- usage in every chunk --------------------------------------------------------------------


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(client, chat):
    common = dict(
        model="toy",
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body=NO_EOS,
    )
    if chat:
        chunks = list(
            client.chat.completions.create(messages=[{"role": "user", "content": "hi"}], **common)
        )
    else:
        chunks = list(client.completions.create(prompt="count with me", **common))
    *body, final = chunks
    assert final.choices == [] and final.usage.completion_tokens == 5
    assert body and all(c.usage is not None for c in body)
    assert {c.usage.prompt_tokens for c in body} == {final.usage.prompt_tokens}
    counts = [c.usage.completion_tokens for c in body]
    assert counts == sorted(counts) and counts[-1] == 5
    assert all(
        c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in body
    )


def test_without_continuous_usage_stats_only_the_last_chunk_has_usage(client):
    chunks = list(
        client.completions.create(
            model="toy",
            prompt="quiet",
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert [c.usage is not None for c in chunks] == [False] * (len(chunks) - 1) + [True]


# -- several choices -------------------------------------------------------------------------


def _texts(response) -> list[str]:
    assert [c.index for c in response.choices] == list(range(len(response.choices)))
    return [c.text for c in response.choices]


def test_n_samples_with_a_seed_are_reproducible_distinct_and_seeded_seed_plus_j(client):
    def ask(n, seed):
        return client.completions.create(
            model="toy",
            prompt="once upon",
            n=n,
            seed=seed,
            temperature=1.0,
            max_tokens=8,
            extra_body=NO_EOS,
        )

    first, again = ask(4, 7), ask(4, 7)
    assert _texts(first) == _texts(again)
    assert len(set(_texts(first))) == 4
    assert _texts(ask(1, 9)) == [_texts(first)[2]]  # sample j draws with seed + j (vLLM's rule)
    assert first.usage.prompt_tokens == ask(1, 7).usage.prompt_tokens  # the prompt once
    assert first.usage.completion_tokens == 4 * 8


def test_greedy_n_gives_n_identical_choices(client, local):
    got = client.chat.completions.create(
        model="toy",
        messages=[{"role": "user", "content": "same"}],
        n=3,
        temperature=0,
        max_tokens=6,
        extra_body=NO_EOS,
    )
    want = _greedy(local, _chat_ids(local, [{"role": "user", "content": "same"}]))
    assert [c.index for c in got.choices] == [0, 1, 2]
    assert [c.message.content for c in got.choices] == [want] * 3
    assert got.usage.completion_tokens == 18


@pytest.mark.parametrize(
    "prompts",
    [["the cat", "a dog sat", "hello"], [[5, 6, 7], [8, 9], [10, 11, 12, 13]]],
    ids=["strings", "token-id-lists"],
)
def test_batched_prompts_give_index_i_times_n_plus_j_and_usage_summed(client, local, prompts):
    got = client.completions.create(
        model="toy", prompt=prompts, n=2, temperature=0, max_tokens=6, extra_body=NO_EOS
    )
    want = [_greedy(local, p) for p in prompts]
    assert _texts(got) == [w for w in want for _ in range(2)]
    lengths = [len(p) if isinstance(p, list) else len(local.tokenizer.encode(p)) for p in prompts]
    assert got.usage.prompt_tokens == sum(lengths)  # each prompt once, as vLLM counts
    assert got.usage.completion_tokens == 6 * 2 * len(prompts)


def test_a_single_token_id_list_is_one_prompt(client, local):
    got = client.completions.create(
        model="toy", prompt=[5, 6, 7], temperature=0, max_tokens=6, extra_body=NO_EOS
    )
    assert _texts(got) == [_greedy(local, [5, 6, 7])]


def test_a_streamed_batch_tags_each_chunk_with_its_choice_index(client, local):
    prompts = ["stream one", "stream two"]
    chunks = list(
        client.completions.create(
            model="toy",
            prompt=prompts,
            n=2,
            temperature=0,
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=NO_EOS,
        )
    )
    texts: dict[int, str] = {}
    finished = set()
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] = texts.get(choice.index, "") + choice.text
        if choice.finish_reason:
            finished.add(choice.index)
    want = [_greedy(local, p) for p in prompts]
    assert texts == {0: want[0], 1: want[0], 2: want[1], 3: want[1]}
    assert finished == {0, 1, 2, 3}
    assert chunks[-1].usage.completion_tokens == 24


def test_one_bad_prompt_refuses_the_batch_before_any_prompt_runs(server):
    before = server.metrics()["rlt_hal_prompt_tokens_total"]
    body = {"model": "toy", "prompt": [[5, 6], [7, 8], [9, 99999]], "max_tokens": 2}
    err = _error(_post(server, "/v1/completions", body))
    assert err["param"] == "prompt[2]" and "outside the vocabulary" in err["message"]
    body = {"model": "toy", "prompt": ["fine", "", "fine"], "max_tokens": 2}
    err = _error(_post(server, "/v1/completions", body))
    assert err["param"] == "prompt[1]" and "empty" in err["message"]
    assert server.metrics()["rlt_hal_prompt_tokens_total"] == before


@pytest.mark.parametrize(
    "prompt, text",
    [(["a", [5]], "all strings or all token-id lists"), ([["a"]], "prompt[0] must be")],
)
def test_a_malformed_batch_is_a_400_on_prompt(server, prompt, text):
    err = _error(_post(server, "/v1/completions", {"model": "toy", "prompt": prompt}))
    assert err["param"] == "prompt" and text in err["message"]


def test_too_many_choices_are_refused_naming_n(server):
    body = {"model": "toy", "prompt": ["a"] * 9, "n": 128, "max_tokens": 1}
    err = _error(_post(server, "/v1/completions", body))
    assert err["param"] == "n" and "at most 1024" in err["message"]


# -- vLLM's tokenizer endpoints, /version, /v1/models/{id} ------------------------------------


def test_tokenize_returns_the_ids_a_completion_runs(server, local):
    r = _post(server, "/tokenize", {"prompt": "hello world", "return_token_strs": True})
    assert r.status_code == 200
    ids = local.tokenizer.encode("hello world", add_special_tokens=False)
    assert r.json() == {
        "count": len(ids),
        "max_model_len": local.engine.max_model_len,
        "tokens": ids,
        "token_strs": local.tokenizer.convert_ids_to_tokens(ids),
    }
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    r = _post(server, "/tokenize", {"model": "toy", "messages": messages})
    assert r.json()["tokens"] == _chat_ids(local, [{"role": "user", "content": "hi"}])
    assert r.json()["token_strs"] is None


def test_detokenize_inverts_tokenize(server):
    ids = _post(server, "/tokenize", {"prompt": "round trip"}).json()["tokens"]
    assert _post(server, "/detokenize", {"tokens": ids}).json() == {"prompt": "round trip"}


def test_tokenizer_info_has_what_lm_eval_reads_and_no_local_paths(server, local):
    info = httpx.get(server.base + "/tokenizer_info").json()
    assert info["eos_token"] == local.tokenizer.eos_token
    assert info["chat_template"] == local.tokenizer.chat_template
    assert info["tokenizer_class"] and "name_or_path" not in info
    json.dumps(info)


def test_version_and_model_retrieval(server, client):
    assert httpx.get(server.base + "/version").json()["version"]
    card = client.models.retrieve("toy")
    assert card.id == "toy" and card.owned_by == "rlt-hal"
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("gpt-4")
    assert caught.value.body["code"] == "model_not_found" and caught.value.body["param"] == "model"


@pytest.mark.parametrize(
    "path, body, param, text",
    [
        ("/tokenize", {"prompt": "a", "messages": []}, "prompt", "exactly one"),
        ("/tokenize", {}, "prompt", "exactly one"),
        ("/tokenize", {"prompt": "a", "add_generation_prompt": True}, "add_generation_prompt", ""),
        ("/tokenize", {"prompt": "a", "model": "gpt-4"}, "model", "does not exist"),
        ("/tokenize", {"prompt": "a", "truncate": 3}, "truncate", "unknown field"),
        ("/tokenize", {"messages": []}, "messages", "empty conversation"),
        ("/detokenize", {"tokens": [1, 5000]}, "tokens", "outside the vocabulary"),
        ("/detokenize", {"tokens": ["x"]}, "tokens[0]", "valid integer"),
    ],
)
def test_tokenizer_endpoint_errors_name_the_field(server, path, body, param, text):
    r = _post(server, path, body)
    err = _error(r, 404 if param == "model" else 400)
    assert err["param"] == param and text in err["message"]
