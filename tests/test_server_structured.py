"""Structured outputs and tool calls through a real server on the random tiny checkpoint and the
official openai client: every output parses and validates, whatever the seed; invalid schemas
are 400s before any compute; speculation changes no bit; tool calls in OpenAI's shapes."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from runtime_glue.engine.llm import LLM
from runtime_glue.engine.sampling import SamplingParams
from runtime_glue.server.tools import MAX_PARALLEL_CALLS, AutoStream, ToolPlan, _hermes_calls
from tests.server_helpers import ServerProcess

SPECULATION = ("--speculative-loops", "1", "--num-speculative-tokens", "3")
# Bounded, so that a random model always finishes: short strings, enums, bounded integers.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "kind": {"enum": ["cat", "dog", "fox"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
        "owner": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 6},
                "verified": {"type": "boolean"},
            },
            "required": ["city", "verified"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "kind", "age", "tags", "owner"],
    "additionalProperties": False,
}
USER = [{"role": "user", "content": "describe a pet"}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def spec_server(tiny_ckpt):
    proc = ServerProcess(tiny_ckpt, *SPECULATION)
    yield proc
    proc.stop()


def _post(server, path, body):
    return httpx.post(server.base + path, json=body, timeout=120)


def _schema_format(schema=SCHEMA, strict=None) -> dict:
    js: dict = {"name": "pet", "schema": schema}
    if strict is not None:
        js["strict"] = strict
    return {"type": "json_schema", "json_schema": js}


# -- JSON, regex, choice ----------------------------------------------------------------------


@pytest.mark.parametrize("seed", [1, 100, 200])
def test_a_nested_schema_parses_and_validates_for_every_sample(client, seed):
    got = client.chat.completions.create(
        model="toy", messages=USER, response_format=_schema_format(), n=8, seed=seed,
        temperature=1.0, max_tokens=400,
    )  # fmt: skip
    for choice in got.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_structured_outputs_json_on_completions_streamed_equals_whole(server):
    body = {
        "model": "toy", "prompt": "a pet:", "max_tokens": 400, "seed": 9, "temperature": 1.0,
        "structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True},
    }  # fmt: skip
    whole = _post(server, "/v1/completions", body).json()["choices"][0]["text"]
    jsonschema.validate(json.loads(whole), SCHEMA)
    assert not re.search(r"\s(?=[\"{}\[\],:])|[{\[,:]\s", whole)  # no whitespace between tokens
    with httpx.stream("POST", server.base + "/v1/completions", json={**body, "stream": True}) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    assert text == whole


def test_a_regex_and_a_choice_are_matched_exactly(server):
    pattern = r"[0-9]{3}-[a-z]{2,4}( ok)?"
    body = {"model": "toy", "prompt": "code:", "max_tokens": 40, "n": 8, "seed": 3}
    got = _post(server, "/v1/completions", {**body, "structured_outputs": {"regex": pattern}})
    for c in got.json()["choices"]:
        assert re.fullmatch(pattern, c["text"]), c["text"]
    options = ["red", "green", "blue (dark)", "blu"]
    got = _post(server, "/v1/completions", {**body, "structured_outputs": {"choice": options}})
    texts = [c["text"] for c in got.json()["choices"]]
    assert set(texts) <= set(options), texts
    (b,) = _post(server, "/tokenize", {"prompt": "b"}).json()["tokens"]
    favoured = {**body, "logit_bias": {str(b): 50}, "structured_outputs": {"choice": options}}
    biased = [c["text"] for c in _post(server, "/v1/completions", favoured).json()["choices"]]
    assert set(biased) <= {"blu", "blue (dark)"}, biased  # the bias acts inside the mask


@pytest.mark.parametrize(
    "field, value, param, message",
    [
        (
            "response_format",
            _schema_format({"type": "array", "uniqueItems": True}, strict=True),
            "response_format.json_schema.schema",
            "unimplemented keys",
        ),
        ("response_format", {"type": "xml"}, "response_format.type", "must be text, json_object"),
        ("structured_outputs", {"regex": "(ab"}, "structured_outputs.regex", "unclosed group"),
        ("structured_outputs", {"grammar": "start: foo"}, "structured_outputs.grammar", "invalid"),
        ("structured_outputs", {"regex": "a", "choice": ["a"]}, "structured_outputs", "one of"),
        ("structured_outputs", {"json": "{not json"}, "structured_outputs.json", "not valid JSON"),
    ],
)
def test_an_invalid_spec_is_a_400_before_any_compute_and_the_server_keeps_serving(
    server, field, value, param, message
):
    before = server.metrics()["rlt_hal_prompt_tokens_total"]
    r = _post(server, "/v1/chat/completions", {"model": "toy", "messages": USER, field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and message in err["message"], err
    assert server.metrics()["rlt_hal_prompt_tokens_total"] == before  # nothing ran
    ok = _post(server, "/v1/chat/completions", {"model": "toy", "messages": USER, "max_tokens": 2})
    assert ok.status_code == 200


def test_not_strict_ignores_what_strict_refuses(server):
    body = {"model": "toy", "messages": USER, "max_tokens": 60, "seed": 1}
    lax = {"type": "array", "items": {"enum": [1, 2, 3]}, "maxItems": 3, "uniqueItems": True}
    r = _post(server, "/v1/chat/completions", {**body, "response_format": _schema_format(lax)})
    assert r.status_code == 200
    text = r.json()["choices"][0]["message"]["content"]
    assert all(x in (1, 2, 3) for x in json.loads(text))
    text_format = {"type": "text"}
    assert _post(
        server, "/v1/chat/completions", {**body, "response_format": text_format}
    ).is_success


def test_constrained_output_is_bit_identical_with_and_without_speculation(
    server, spec_server, tiny_ckpt
):
    spec = {"json": SCHEMA, "disable_any_whitespace": True}
    body = {
        "model": "toy", "prompt": "a pet:", "max_tokens": 300, "seed": 21, "temperature": 0.9,
        "n": 3, "logprobs": 2, "structured_outputs": spec,
    }  # fmt: skip
    plain = _post(server, "/v1/completions", body).json()["choices"]
    fast = _post(spec_server, "/v1/completions", body).json()["choices"]
    assert plain == fast
    local = LLM(tiny_ckpt, block_size=16, num_blocks=64)
    params = SamplingParams(
        max_tokens=300, seed=21, temperature=0.9, n=3, logprobs=2, structured_outputs=spec
    )
    [request] = local.generate([local.encode("a pet:")], params)
    offline = request.outputs
    assert [c["text"] for c in plain] == [o.text for o in offline]
    assert [c["logprobs"]["token_logprobs"] for c in plain] == [
        [row[t].logprob for t, row in zip(o.token_ids, o.logprobs, strict=True)] for o in offline
    ]


class Pet(BaseModel):
    name: str = Field(max_length=8)
    kind: str = Field(json_schema_extra={"enum": ["cat", "dog"]})
    legs: int = Field(ge=0, le=8)


def _parse_pets(client, seeds) -> None:
    for seed in seeds:
        got = client.chat.completions.parse(
            model="toy", messages=USER, response_format=Pet, seed=seed
        )  # no max_tokens: a chat request runs to what is left of the context (vLLM's default)
        pet = got.choices[0].message.parsed
        assert isinstance(pet, Pet) and pet.kind in ("cat", "dog") and 0 <= pet.legs <= 8


def test_the_openai_sdk_parses_into_a_pydantic_model_every_time(client):
    _parse_pets(client, range(6))


# -- tool calls -------------------------------------------------------------------------------

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["utc", "cet"]}},
            "required": ["zone"],
            "additionalProperties": False,  # else any extra keys: a random model may not stop
        },
    },
}
TOOLS = [WEATHER, TIME]


def _check_calls(calls) -> None:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    assert calls
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


@pytest.mark.parametrize("parallel", [False, True])
def test_a_required_tool_call_is_always_a_valid_call(client, parallel):
    for seed in range(4):
        got = client.chat.completions.create(
            model="toy", messages=USER, tools=TOOLS, tool_choice="required", seed=seed,
            parallel_tool_calls=parallel, max_tokens=300,
        )  # fmt: skip
        choice = got.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        _check_calls(choice.message.tool_calls)
        if not parallel:
            assert len(choice.message.tool_calls) == 1


def test_a_forced_call_keeps_a_response_format_for_a_later_turn(client, server):
    """OpenAI's rule (the Agents SDK sends both): the forced call's turn is a call; the format,
    its shape checked, shapes no message there."""
    got = client.chat.completions.create(
        model="toy", messages=USER, tools=TOOLS, tool_choice="required", seed=1, max_tokens=300,
        response_format=_schema_format(),
    )  # fmt: skip
    assert got.choices[0].finish_reason == "tool_calls"
    _check_calls(got.choices[0].message.tool_calls)
    bad = {"type": "xml"}
    r = _post(server, "/v1/chat/completions", {"model": "toy", "messages": USER, "tools": TOOLS,
              "tool_choice": "required", "response_format": bad})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("response_format")


def test_a_named_tool_call_streams_as_deltas_and_round_trips(client):
    kwargs = dict(
        model="toy", messages=USER, tools=TOOLS, max_tokens=200, seed=5,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )  # fmt: skip
    whole = client.chat.completions.create(**kwargs).choices[0]
    (call,) = whole.message.tool_calls
    assert call.function.name == "get_weather" and whole.finish_reason == "tool_calls"
    _check_calls([call])
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert [d.function.arguments for d in deltas] == [call.function.arguments]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    turns = [
        *USER,
        whole.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'},
    ]
    after = client.chat.completions.create(model="toy", messages=turns, max_tokens=4)
    assert after.choices[0].finish_reason in ("length", "stop")


@pytest.mark.parametrize(
    "extra, param, message",
    [
        ({"tools": TOOLS}, "tool_choice", "tool_choice 'auto' needs a chat template that renders"),
        ({"tool_choice": "required"}, "tool_choice", "tool_choice needs tools"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name",
            "not among the tools",
        ),
        (
            {"tools": TOOLS, "tool_choice": "required", "structured_outputs": {"regex": "a"}},
            "tool_choice",
            "cannot be combined with structured_outputs",
        ),
        ({"tools": [WEATHER, WEATHER], "tool_choice": "none"}, "tools", "unique"),
    ],
)
def test_tool_requests_the_server_cannot_honour_are_400s_naming_the_field(
    server, extra, param, message
):
    r = _post(server, "/v1/chat/completions", {"model": "toy", "messages": USER, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and message in err["message"], err


def test_tool_choice_none_answers_in_text(client):
    got = client.chat.completions.create(
        model="toy", messages=USER, tools=TOOLS, tool_choice="none", max_tokens=4
    )
    assert got.choices[0].message.tool_calls is None and got.choices[0].message.content


# -- auto, with a template that renders tools ----------------------------------------------------


def test_auto_renders_the_tools_and_parses_the_calls_the_model_writes(tool_server):
    client = openai.OpenAI(base_url=tool_server.base + "/v1", api_key="x", max_retries=0)
    bare = client.chat.completions.create(model="toy", messages=USER, max_tokens=1)
    # The model is made to write a call (a regex): auto must find it, streamed or not.
    said = (
        'let me look. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    )
    kwargs = dict(
        model="toy", messages=USER, tools=TOOLS, max_tokens=80,
        extra_body={"structured_outputs": {"regex": re.escape(said)}},
    )  # fmt: skip
    got = client.chat.completions.create(**kwargs)
    assert got.usage.prompt_tokens > bare.usage.prompt_tokens + 20  # the tools were rendered
    message = got.choices[0].message
    assert message.content == "let me look. " and got.choices[0].finish_reason == "tool_calls"
    (call,) = message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather",
        {"city": "Oslo"},
    )
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    (streamed,) = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert content == "let me look. " and streamed.function.arguments == call.function.arguments
    plain = client.chat.completions.create(model="toy", messages=USER, tools=TOOLS, max_tokens=5)
    assert plain.choices[0].message.tool_calls is None  # no call written: plain content


def test_hermes_blocks_are_parsed_and_anything_else_stays_content():
    text = 'a<tool_call>{"name":"f","arguments":{"x":1}}</tool_call>b<tool_call>{bad</tool_call>'
    content, calls = _hermes_calls(text)
    assert content == "ab<tool_call>{bad</tool_call>"
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("f", '{"x":1}')
    ]
    assert _hermes_calls("no call") == ("no call", [])
    stream, sent = AutoStream(), []
    for end in range(1, len(text) + 1):
        sent.append(stream.feed(text[:end]))
    assert "".join(sent) == "a"  # held from the first '<' that could begin a tag


def test_a_required_schema_is_the_tools_parameters():
    tools = tuple(t for t in TOOLS)
    one = json.loads(ToolPlan("required", tools, False, parallel=False).spec().text)
    assert [c["properties"]["name"]["const"] for c in one["anyOf"]] == ["get_weather", "get_time"]
    many = json.loads(ToolPlan("required", tools, False, parallel=True).spec().text)
    assert many["type"] == "array" and many["minItems"] == 1 and many["items"] == one
    assert many["maxItems"] == MAX_PARALLEL_CALLS
    named = json.loads(ToolPlan("named", tools, False, name="get_time").spec().text)
    assert named == TIME["function"]["parameters"]


def test_the_server_prewarms_the_grammar_engine(tiny_ckpt):
    from runtime_glue.server.app import Server

    llm = LLM(tiny_ckpt, block_size=16, num_blocks=64)
    Server(llm, "toy").prewarm()
    assert llm.engine.grammar_compiler()._ll_tokenizer is not None


def test_requests_without_structured_outputs_never_build_the_grammar_compiler(tiny_ckpt):
    """The compiler loads a tokenizer of its own: only a structured request may pay for it."""
    llm = LLM(tiny_ckpt, block_size=16, num_blocks=64)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
    assert llm.engine._compiler is None
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, structured_outputs={"choice": ["a"]}))
    assert llm.engine._compiler is not None


def test_on_the_default_model_parse_and_a_required_call_succeed_every_time(default_server):
    client = openai.OpenAI(base_url=default_server.base + "/v1", api_key="x", max_retries=0)
    _parse_pets(client, range(4))
    for seed in range(4):
        got = client.chat.completions.create(
            model="toy",
            messages=USER,
            tools=TOOLS,
            tool_choice="required",
            seed=seed,
        )  # fmt: skip  (parallel_tool_calls on, OpenAI's default; no max_tokens)
        assert got.choices[0].finish_reason == "tool_calls"
        assert 1 <= len(got.choices[0].message.tool_calls) <= MAX_PARALLEL_CALLS
        _check_calls(got.choices[0].message.tool_calls)
