"""The request schema vLLM users bring (issue 45): every field of OpenAI's chat request as the
openai package lists it, vLLM's extra fields and limits (``--max-model-len``, chat templates,
priority), and what a field the schema lacks is told. Through a real ``rlt-hal serve``."""

from __future__ import annotations

import httpx
import openai
import pytest

from runtime_glue.engine.llm import LLM
from tests.server_helpers import ServerProcess


def _post(server, path, body):
    return httpx.post(server.base + path, json=body, timeout=60)


def test_max_model_len_caps_requests_and_chat_runs_to_it_by_default(tiny_ckpt):
    """--max-model-len as vLLM's: /v1/models reports it, a longer request is a 400, a chat
    request without max_tokens runs to what is left of it (vLLM's default), a completions
    request keeps OpenAI's 16."""
    proc = ServerProcess(tiny_ckpt, "--max-model-len", "48")
    try:
        client = openai.OpenAI(base_url=proc.base + "/v1", api_key="unused", max_retries=0)
        [model] = client.models.list().data
        assert model.model_extra["max_model_len"] == 48
        chat = client.chat.completions.create(
            model="toy",
            messages=[{"role": "user", "content": "hi"}],
            extra_body={"ignore_eos": True},
        )
        used = chat.usage
        assert used.prompt_tokens + used.completion_tokens == 48 and used.completion_tokens > 16
        assert chat.choices[0].finish_reason == "length"
        text = client.completions.create(model="toy", prompt="hi", extra_body={"ignore_eos": True})
        assert text.usage.completion_tokens == 16
        with pytest.raises(openai.BadRequestError, match="maximum length of 48 tokens"):
            client.completions.create(model="toy", prompt="hi", max_tokens=48)
    finally:
        proc.stop()


def test_max_model_len_is_refused_beyond_the_model_or_the_pool(tiny_ckpt, tiny_config):
    too_long = tiny_config.max_position_embeddings + 1
    with pytest.raises(ValueError, match=r"max_model_len must be in \[1, "):
        LLM(tiny_ckpt, max_model_len=too_long, block_size=16, num_blocks=8)
    with pytest.raises(ValueError, match="--max-model-len 512: the KV pool holds 64 tokens"):
        LLM(tiny_ckpt, max_model_len=512, block_size=16, num_blocks=4)
    llm = LLM(tiny_ckpt, max_model_len=40, block_size=16, num_blocks=8)
    assert llm.engine.max_model_len == 40 and llm.engine.request_capacity(10) == 40


# A value for every field of OpenAI's chat request, with what it needs beside it. The list of
# fields is the openai package's own (the test fails on a field it adds that has no entry).
MESSAGES = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
CHAT_FIELD_VALUES: dict[str, tuple] = {
    "messages": (MESSAGES, {}),
    "model": ("toy", {}),
    "max_tokens": (2, {}),
    "max_completion_tokens": (2, {}),
    "temperature": (0.5, {}),
    "top_p": (0.9, {}),
    "n": (2, {}),
    "seed": (7, {}),
    "stop": (["zz"], {}),
    "frequency_penalty": (0.1, {}),
    "presence_penalty": (0.1, {}),
    "logit_bias": ({"5": 1.0}, {}),
    "logprobs": (True, {}),
    "top_logprobs": (2, {"logprobs": True}),
    "response_format": ({"type": "text"}, {}),
    "stream_options": ({"include_usage": True}, {"stream": True}),
    "tools": ([TOOL], {"tool_choice": "none"}),  # (auto needs a template rendering tools)
    "tool_choice": ("none", {"tools": [TOOL]}),
    "parallel_tool_calls": (False, {"tools": [TOOL], "tool_choice": "none"}),
    "user": ("u1", {}),
    "metadata": ({"team": "a"}, {}),
    "moderation": (None, {}),
    "prediction": ({"type": "content", "content": "hi there"}, {}),
    "prompt_cache_key": ("k", {}),
    "prompt_cache_options": (None, {}),
    "prompt_cache_retention": ("in-memory", {}),
    "reasoning_effort": ("low", {}),
    "safety_identifier": ("s1", {}),
    "service_tier": ("auto", {}),
    "store": (False, {}),
    "verbosity": ("low", {}),
    "modalities": (["text"], {}),
    "audio": (None, {}),
    "web_search_options": (None, {}),
    "functions": (None, {}),
    "function_call": (None, {}),
}


def _openai_chat_fields() -> set[str]:
    from openai.types.chat import completion_create_params as params

    return set(params.CompletionCreateParamsBase.__annotations__)


def test_every_field_of_openais_chat_request_is_accepted(server):
    fields = _openai_chat_fields()
    assert fields - set(CHAT_FIELD_VALUES) == set(), "a field the openai package lists"
    for name in sorted(fields):
        value, beside = CHAT_FIELD_VALUES[name]
        body = {"model": "toy", "messages": MESSAGES, "max_tokens": 2, **beside, name: value}
        r = _post(server, "/v1/chat/completions", body)
        assert r.status_code == 200, (name, r.text)


@pytest.mark.parametrize(
    "field, value, says",
    [
        ("audio", {"voice": "alloy", "format": "mp3"}, "audio output is not supported"),
        ("modalities", ["text", "audio"], 'only ["text"] is supported'),
        ("web_search_options", {"search_context_size": "low"}, "web search is not available"),
        ("functions", [TOOL["function"]], "functions is deprecated by OpenAI; give them as tools"),
        ("function_call", "auto", "use tool_choice"),
        ("guided_json", {"type": "object"}, 'use "structured_outputs": {"json": ...}'),
        ("guided_choice", ["a", "b"], 'use "structured_outputs": {"choice": ...}'),
        ("max_token", 3, "unknown field 'max_token' is not supported (did you mean 'max_tokens'?)"),
    ],
)
def test_what_cannot_be_given_here_is_a_400_that_says_what_to_use(server, field, value, says):
    r = _post(server, "/v1/chat/completions", {"model": "toy", "messages": MESSAGES, field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field
    assert says in r.json()["error"]["message"]
    assert _post(server, "/v1/chat/completions", {"model": "toy", "messages": MESSAGES,
                                                  "max_tokens": 1}).status_code == 200  # fmt: skip


def test_vllms_chat_template_fields_render_as_tokenize_renders_them(server, tiny_ckpt):
    """add_generation_prompt / continue_final_message: the prompt /tokenize gives for the same
    flags; chat_template: only on a server that trusts request templates; priority: 0 only."""
    convo = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello, I"}]
    flags = {"add_generation_prompt": False, "continue_final_message": True}
    ids = _post(server, "/tokenize", {"model": "toy", "messages": convo, **flags}).json()
    r = _post(server, "/v1/chat/completions",
              {"model": "toy", "messages": convo, "max_tokens": 1, **flags})  # fmt: skip
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == ids["count"]
    plain = _post(
        server, "/v1/chat/completions", {"model": "toy", "messages": convo, "max_tokens": 1}
    )
    assert plain.json()["usage"]["prompt_tokens"] != ids["count"]
    both = {"add_generation_prompt": True, "continue_final_message": True}
    r = _post(server, "/v1/chat/completions", {"model": "toy", "messages": convo, **both})
    assert r.status_code == 400
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    body = {"model": "toy", "messages": convo, "max_tokens": 1, "chat_template": template}
    r = _post(server, "/v1/chat/completions", body)
    assert r.status_code == 400 and "--trust-request-chat-template" in r.text
    r = _post(server, "/v1/chat/completions", {**body, "chat_template": None, "priority": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
    trusting = ServerProcess(tiny_ckpt, "--trust-request-chat-template")
    try:
        r = httpx.post(trusting.base + "/v1/chat/completions", json=body, timeout=60)
        text_ids = httpx.post(
            trusting.base + "/tokenize", json={"model": "toy", "prompt": "hiHello, I"}, timeout=60
        ).json()
    finally:
        trusting.stop()
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == text_ids["count"]


def test_chat_template_kwargs_reach_the_template_as_vllm_passes_them(server):
    """Over the request's own flags (vLLM's order), in chat and /tokenize alike; the renderer's
    own arguments (the template, the tools, tokenize) are refused by name."""
    convo = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello, I"}]
    over = {"add_generation_prompt": False, "continue_final_message": True}
    kwargs = {"model": "toy", "messages": convo, "chat_template_kwargs": over}
    via_kwargs = _post(server, "/tokenize", kwargs).json()
    via_flags = _post(server, "/tokenize", {"model": "toy", "messages": convo, **over}).json()
    plain = _post(server, "/tokenize", {"model": "toy", "messages": convo}).json()
    assert via_kwargs["tokens"] == via_flags["tokens"] != plain["tokens"]
    r = _post(server, "/v1/chat/completions", {**kwargs, "max_tokens": 1})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == via_kwargs["count"]
    thinking = {"model": "toy", "messages": MESSAGES, "max_tokens": 1,
                "chat_template_kwargs": {"enable_thinking": True}}  # fmt: skip
    assert _post(server, "/v1/chat/completions", thinking).status_code == 200  # unused: fine
    for bad in ({"tokenize": True}, {"chat_template": "{{ 'x' }}"}, {"tools": []}):
        for path in ("/v1/chat/completions", "/tokenize"):
            r = _post(
                server, path, {"model": "toy", "messages": MESSAGES, "chat_template_kwargs": bad}
            )
            assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
            assert repr(next(iter(bad))) in r.json()["error"]["message"]
    r = _post(server, "/tokenize", {"model": "toy", "prompt": "hi", "chat_template_kwargs": {}})
    assert r.status_code == 400 and "applies to messages only" in r.text


def _chat(server, **fields):
    body = {"model": "toy", "messages": MESSAGES, "temperature": 0, "max_tokens": 8, **fields}
    r = _post(server, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    return r.json()


def test_vllms_detokenizing_fields_as_vllm_defines_them(server, tiny_ckpt):
    from transformers import AutoTokenizer

    end = AutoTokenizer.from_pretrained(tiny_ckpt).convert_tokens_to_ids("<|im_end|>")
    forced = {"logit_bias": {str(end): 100}, "ignore_eos": True, "max_tokens": 2}
    assert _chat(server, **forced)["choices"][0]["message"]["content"] == ""
    shown = _chat(server, **forced, skip_special_tokens=False, spaces_between_special_tokens=False)
    assert shown["choices"][0]["message"]["content"] == "<|im_end|><|im_end|>"
    # The token that ends a request adds no text (vLLM's), unless include_stop_str_in_output.
    ending = {**forced, "ignore_eos": False, "stop_token_ids": [end], "skip_special_tokens": False}
    assert _chat(server, **ending)["choices"][0]["message"]["content"] == ""
    kept_end = _chat(server, **ending, include_stop_str_in_output=True)["choices"][0]
    assert kept_end["message"]["content"] == "<|im_end|>" and kept_end["finish_reason"] == "stop"
    text = _chat(server, ignore_eos=True)["choices"][0]["message"]["content"]
    stop = text[2:4]
    at = text.find(stop)
    cut = _chat(server, ignore_eos=True, stop=[stop])["choices"][0]["message"]["content"]
    kept = _chat(server, ignore_eos=True, stop=[stop], include_stop_str_in_output=True)
    assert cut == text[:at] and kept["choices"][0]["message"]["content"] == text[: at + 2]
    assert kept["choices"][0]["finish_reason"] == "stop"


def test_vllms_request_id_and_token_ids_as_logprob_tokens(server):
    got = _chat(server, request_id="my-job-7", user="u1", metadata={"team": "a"})
    assert got["id"] == "chatcmpl-my-job-7"
    again = _chat(server, request_id="my-job-7")  # the same id again: a separate request
    assert again["id"] == "chatcmpl-my-job-7"
    assert 'request "chatcmpl-my-job-7": user="u1" metadata={"team": "a"}' in server.output()
    plain = _chat(server, logprobs=True, top_logprobs=2)["choices"][0]["logprobs"]["content"]
    ids = _chat(server, logprobs=True, top_logprobs=2, return_tokens_as_token_ids=True)
    as_ids = ids["choices"][0]["logprobs"]["content"]
    assert [e["logprob"] for e in as_ids] == [e["logprob"] for e in plain]
    for entry in as_ids:
        assert entry["token"].startswith("token_id:") and entry["token"][9:].isdigit()
        assert all(t["token"].startswith("token_id:") for t in entry["top_logprobs"])
    detok = _post(server, "/detokenize",
                  {"model": "toy", "tokens": [int(e["token"][9:]) for e in as_ids]})  # fmt: skip
    assert detok.json()["prompt"] == "".join(e["token"] for e in plain)
