"""OpenAI's Responses API (``POST /v1/responses``) through a real server and the official openai
client: each answer equals the chat endpoint's for the same messages (greedy), whole and
streamed; tool calls round-trip by ``previous_response_id`` and by items; reasoning items on a
Thinking checkpoint; stored responses; refusals naming the Responses field."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseItemList, ResponseStreamEvent
from pydantic import TypeAdapter

from runtime_glue.cli.main import main as cli
from runtime_glue.server.protocol import ApiError
from runtime_glue.server.response_input import PASSED_ON, ResponsesRequest
from runtime_glue.server.response_output import ResponseEvents
from runtime_glue.server.responses import ResponseStore, Stored
from tests.server_helpers import ServerProcess

EVENTS = TypeAdapter(ResponseStreamEvent)
GREEDY = {"model": "toy", "temperature": 0}
USER = [{"role": "user", "content": "Hello"}]
# Bounded, so that a random model always finishes (status completed).
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "kind": {"enum": ["cat", "dog"]}},
    "required": ["name", "kind"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "the weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
NAMED = {"type": "function", "name": "get_weather"}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0)


def _post(server, body, path="/v1/responses", **kwargs):
    return httpx.post(server.base + path, json=body, timeout=120, **kwargs)


def _create(server, **body) -> Response:
    """A response as the server sent it, validated by the SDK's own model (the client's
    ``responses.create`` constructs without validating)."""
    r = _post(server, body)
    assert r.status_code == 200, r.text
    return Response.model_validate(r.json())


def _chat(client, messages, **kwargs):
    return client.chat.completions.create(model="toy", messages=messages, temperature=0, **kwargs)


def _sse(server, body) -> list[dict]:
    """A streamed response's events; each ``event:`` line names its data's type, and each
    event validates as the SDK's stream event type."""
    events = []
    with httpx.stream("POST", server.base + "/v1/responses", json={**body, "stream": True},
                      timeout=120) as r:  # fmt: skip
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                assert event["type"] == name
                EVENTS.validate_python(event)
                events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


# -- answers ---------------------------------------------------------------------------------


def test_a_string_input_answers_as_chat_does_and_max_output_tokens_makes_it_incomplete(
    server, client
):
    got = _create(server, **GREEDY, input="Hello", max_output_tokens=6)
    chat = _chat(client, USER, max_tokens=6)
    assert got.id.startswith("resp_") and got.object == "response" and got.model == "toy"
    assert got.output_text == chat.choices[0].message.content and got.output_text
    assert chat.choices[0].finish_reason == "length"
    assert got.status == "incomplete" and got.incomplete_details.reason == "max_output_tokens"
    (item,) = got.output
    assert item.type == "message" and item.role == "assistant" and item.status == "incomplete"
    assert got.usage.input_tokens == chat.usage.prompt_tokens
    assert got.usage.output_tokens == 6 and got.usage.total_tokens == chat.usage.total_tokens
    assert got.usage.output_tokens_details.reasoning_tokens == 0
    assert (got.max_output_tokens, got.temperature, got.store) == (6, 0.0, True)
    # the client's own call gets the same answer
    sdk = client.responses.create(model="toy", input="Hello", max_output_tokens=6, temperature=0)
    assert sdk.output_text == got.output_text and sdk.id != got.id


def test_seed_and_top_p_reach_the_sampler(server, client):
    """At temperature 1: the same seed gives the same sample, as chat's does with it; other
    seeds give others; a tiny top_p leaves the likeliest token alone (greedy decoding)."""
    sample = {"model": "toy", "input": "Hello", "max_output_tokens": 8, "temperature": 1.0}
    said = {s: client.responses.create(**sample, extra_body={"seed": s}).output_text
            for s in (7, 8, 9)}  # fmt: skip
    again = client.responses.create(**sample, extra_body={"seed": 7})
    assert again.output_text == said[7] and len(set(said.values())) > 1
    chat = client.chat.completions.create(model="toy", messages=USER, max_tokens=8,
                                          temperature=1.0, seed=7)  # fmt: skip
    assert chat.choices[0].message.content == said[7]
    greedy = _create(server, **GREEDY, input="Hello", max_output_tokens=8).output_text
    assert greedy not in said.values()
    narrow = client.responses.create(**sample, top_p=1e-6, extra_body={"seed": 8})
    assert narrow.output_text == greedy and narrow.top_p == 1e-6


def test_a_list_of_items_with_instructions_is_the_chat_conversation(server, client):
    items = [
        {"role": "user", "content": "Hi"},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Hello", "annotations": []}]},
        {"role": "developer", "content": "be brief"},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
    ]  # fmt: skip
    messages = [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": "a\nb"},
    ]
    got = _create(server, **GREEDY, input=items, instructions="Answer in French.",
                  max_output_tokens=5)  # fmt: skip
    chat = _chat(client, messages, max_tokens=5)
    assert got.output_text == chat.choices[0].message.content
    assert got.usage.input_tokens == chat.usage.prompt_tokens
    assert got.instructions == "Answer in French."
    bare = _create(server, **GREEDY, input=items, max_output_tokens=5)
    assert bare.usage.input_tokens < got.usage.input_tokens  # the instructions were rendered


def test_items_sent_back_as_the_sdk_keeps_them_are_the_chat_turns(server, client):
    """A reasoning item is left out of the prompt; a function call joins the assistant message
    before it; its output is a tool message."""
    call = {
        "type": "function_call",
        "call_id": "c1",
        "name": "get_weather",
        "arguments": '{"city":"Oslo","unit":"c"}',
        "id": "fc_1",
        "status": "completed",
    }
    items = [
        {"role": "user", "content": "weather?"},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "ask the tool"}]},
        {"type": "message", "role": "assistant", "content": [
            {"type": "output_text", "text": "Let me see.", "annotations": []}]},
        call,
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"role": "user", "content": "thanks"},
    ]  # fmt: skip
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "Let me see.", "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": call["arguments"]}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "user", "content": "thanks"},
    ]  # fmt: skip
    got = _create(server, **GREEDY, input=items, max_output_tokens=5)
    chat = _chat(client, messages, max_tokens=5)
    assert got.output_text == chat.choices[0].message.content
    assert got.usage.input_tokens == chat.usage.prompt_tokens
    kept = [item for item in items if item.get("type") != "reasoning"]
    without = _create(server, **GREEDY, input=kept, max_output_tokens=5)
    assert without.usage.input_tokens == got.usage.input_tokens  # the reasoning was left out


def test_text_format_json_schema_gives_json_that_validates_completed(server, client):
    fmt = {"type": "json_schema", "name": "pet", "schema": SCHEMA, "strict": True}
    got = _create(server, **GREEDY, input="describe a pet", text={"format": fmt})
    assert got.status == "completed" and got.incomplete_details is None
    jsonschema.validate(json.loads(got.output_text), SCHEMA)
    json_schema = {"name": "pet", "schema": SCHEMA, "strict": True}
    chat = _chat(client, [{"role": "user", "content": "describe a pet"}],
                 response_format={"type": "json_schema", "json_schema": json_schema})  # fmt: skip
    assert got.output_text == chat.choices[0].message.content
    assert got.text.format.type == "json_schema" and got.output[0].status == "completed"
    obj = _create(server, **GREEDY, input="any", text={"format": {"type": "json_object"}},
                  max_output_tokens=40)  # fmt: skip
    said = _chat(client, [{"role": "user", "content": "any"}], max_tokens=40,
                 response_format={"type": "json_object"}).choices[0]  # fmt: skip
    assert obj.output_text == said.message.content and obj.output_text.startswith("{")
    assert obj.status == ("incomplete" if said.finish_reason == "length" else "completed")


# -- tools -------------------------------------------------------------------------------------


def test_a_named_function_call_round_trips_by_previous_response_id_and_by_items(server, client):
    ask = "weather in Oslo?"
    called = _create(server, **GREEDY, input=ask, tools=[WEATHER], tool_choice=NAMED)
    (call,) = called.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert called.status == "completed" and called.output_text == ""
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    chat_tool = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
    chat = _chat(client, [{"role": "user", "content": ask}], tools=[chat_tool],
                 tool_choice={"type": "function", "function": {"name": "get_weather"}})  # fmt: skip
    assert call.arguments == chat.choices[0].message.tool_calls[0].function.arguments
    assert called.tool_choice.name == "get_weather" and called.tools[0].name == "get_weather"

    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}
    followed = _create(server, **GREEDY, previous_response_id=called.id, input=[result],
                       tools=[WEATHER], tool_choice="none", max_output_tokens=6)  # fmt: skip
    (message,) = followed.output
    assert message.type == "message" and followed.output_text
    # the same conversation as items (the call as the SDK dumps it), and as chat messages
    items = [{"role": "user", "content": ask}, call.model_dump(exclude_none=True), result]
    explicit = _create(server, **GREEDY, input=items, max_output_tokens=6)
    assert explicit.output_text == followed.output_text
    assert explicit.usage.input_tokens == followed.usage.input_tokens
    messages = [
        {"role": "user", "content": ask},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function",
             "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 C"},
    ]  # fmt: skip
    chat = _chat(client, messages, max_tokens=6)
    assert followed.output_text == chat.choices[0].message.content
    assert followed.usage.input_tokens == chat.usage.prompt_tokens


def test_a_required_call_streams_its_arguments_and_the_final_response_has_it(server, client):
    body = {**GREEDY, "input": "time?", "tools": [WEATHER], "tool_choice": "required",
            "parallel_tool_calls": False}  # fmt: skip
    whole = _create(server, **body)
    events = _sse(server, body)
    kinds = [e["type"] for e in events]
    assert kinds == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed",
    ]  # fmt: skip
    (call,) = whole.output
    done = events[-1]["response"]["output"][0]
    assert (done["name"], done["arguments"]) == (call.name, call.arguments)
    assert events[3]["delta"] == events[4]["arguments"] == call.arguments
    assert events[2]["item"]["status"] == "in_progress" and events[5]["item"] == done
    # the SDK's own stream helper assembles the same call
    with client.responses.stream(model="toy", **body_of(body)) as stream:
        deltas = [e.delta for e in stream if e.type == "response.function_call_arguments.delta"]
        final = stream.get_final_response()
    (got,) = final.output
    assert (got.type, got.name, got.arguments) == ("function_call", call.name, call.arguments)
    assert "".join(deltas) == call.arguments


def test_the_sdk_makes_a_function_call_and_sends_its_output_back_for_a_final_message(client):
    """The openai SDK's own calls, as its function-calling guide has them: the call item it
    returned goes back in ``input`` with its output (and, alike, by previous_response_id)."""
    ask = {"role": "user", "content": "weather in Oslo?"}
    for choice in ("required", NAMED):
        called = client.responses.create(model="toy", input=[ask], tools=[WEATHER],
                                         tool_choice=choice, parallel_tool_calls=False,
                                         temperature=0)  # fmt: skip
        assert called.status == "completed" and called.output_text == ""
        (call,) = called.output
        assert (call.type, call.name, call.status) == ("function_call", "get_weather", "completed")
        args = json.loads(call.arguments)
        jsonschema.validate(args, WEATHER["parameters"])
        result = {"type": "function_call_output", "call_id": call.call_id,
                  "output": f"sunny in {args['city']}"}  # fmt: skip
        final = client.responses.create(model="toy", input=[ask, call, result], tools=[WEATHER],
                                        tool_choice="none", temperature=0,
                                        max_output_tokens=6)  # fmt: skip
        assert [item.type for item in final.output] == ["message"] and final.output_text
        assert final.usage.input_tokens > called.usage.input_tokens  # the call and its output
        chained = client.responses.create(model="toy", previous_response_id=called.id,
                                          input=[result], tools=[WEATHER], tool_choice="none",
                                          temperature=0, max_output_tokens=6)  # fmt: skip
        assert chained.output_text == final.output_text
        assert chained.usage.input_tokens == final.usage.input_tokens


def body_of(body: dict) -> dict:
    """A raw request body as the SDK's keyword arguments (its extras in extra_body)."""
    known = {"input", "tools", "tool_choice", "parallel_tool_calls", "temperature", "top_p",
             "max_output_tokens", "instructions", "text", "reasoning", "store"}  # fmt: skip
    out = {k: v for k, v in body.items() if k in known}
    extra = {k: v for k, v in body.items() if k not in known and k != "model"}
    return {**out, "extra_body": extra} if extra else out


def test_an_auto_call_after_some_text_is_a_message_then_a_function_call(tool_server):
    """The model is made to write text and then a Hermes call block (a regex): the response
    holds the text as a message and the call as a function_call item, whole and streamed."""
    said = (
        'let me look. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    )
    body = {**GREEDY, "input": "weather?", "tools": [WEATHER], "max_output_tokens": 80,
            "structured_outputs": {"regex": re.escape(said)}}  # fmt: skip
    whole = _create(tool_server, **body)
    message, call = whole.output
    assert message.type == "message" and whole.output_text == "let me look. "
    assert (call.type, call.name, json.loads(call.arguments)) == (
        "function_call",
        "get_weather",
        {"city": "Oslo"},
    )
    assert whole.status == "completed"
    events = _sse(tool_server, body)
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    kinds = [e["type"] for e in events]
    assert text == "let me look. "
    assert kinds.index("response.output_text.done") < kinds.index(
        "response.function_call_arguments.delta"
    )
    final = events[-1]["response"]
    assert [item["type"] for item in final["output"]] == ["message", "function_call"]
    assert final["output"][1]["arguments"] == call.arguments


# -- streams -----------------------------------------------------------------------------------


def test_a_stream_sends_the_events_in_order_and_ends_with_the_whole_response(server, client):
    fmt = {"type": "json_schema", "name": "pet", "schema": SCHEMA}
    body = {**GREEDY, "input": "describe a pet", "text": {"format": fmt}}
    whole = _create(server, **body)
    events = _sse(server, body)
    kinds = [e["type"] for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas > 1
    assert kinds == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", *["response.output_text.delta"] * deltas,
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    final = events[-1]["response"]
    assert text == whole.output_text == final["output"][0]["content"][0]["text"]
    assert events[0]["response"]["status"] == "in_progress" and final["status"] == "completed"
    assert events[0]["response"]["id"] == final["id"]
    assert final["usage"] == whole.usage.model_dump(exclude_none=True)
    # the SDK's stream helper accepts every event and assembles the same response
    with client.responses.stream(model="toy", input="describe a pet", temperature=0,
                                 text={"format": fmt}) as stream:  # fmt: skip
        seen = [event.type for event in stream]
        final = stream.get_final_response()
    assert seen == kinds and final.output_text == whole.output_text
    assert final.status == "completed"


def test_a_stream_cut_by_max_output_tokens_ends_incomplete_with_the_same_text(server, client):
    whole = _create(server, **GREEDY, input="Hello", max_output_tokens=7)
    events = _sse(server, {**GREEDY, "input": "Hello", "max_output_tokens": 7})
    assert events[-1]["type"] == "response.incomplete"
    final = events[-1]["response"]
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["output"][0]["status"] == "incomplete"
    assert final["output"][0]["content"][0]["text"] == whole.output_text
    assert final["usage"]["output_tokens"] == 7
    chunks = client.responses.create(model="toy", input="Hello", max_output_tokens=7,
                                     temperature=0, stream=True)  # fmt: skip
    text = "".join(e.delta for e in chunks if e.type == "response.output_text.delta")
    assert text == whole.output_text


# -- reasoning ---------------------------------------------------------------------------------

# A budget ends the random weights' reasoning with the end tag and a grammar makes them write a
# word after it (as tests/test_thinking.py does); Responses carries vLLM's thinking_token_budget
# and structured_outputs as chat does.
THINK = {"thinking_token_budget": 6, "structured_outputs": {"regex": "[a-z]{2,6}"},
         "chat_template_kwargs": {"enable_thinking": True}}  # fmt: skip


@pytest.fixture(scope="module")
def thinking_server(tmp_path_factory):
    out = tmp_path_factory.mktemp("thinking") / "ckpt"
    assert cli(["toy-checkpoint", str(out), "--thinking"]) == 0
    proc = ServerProcess(out, "--reasoning-parser", "deepseek_r1", "--api-key", "k")
    yield proc
    proc.stop()


def test_a_thinking_model_gives_a_reasoning_item_then_its_message_whole_and_streamed(
    thinking_server,
):
    auth = {"authorization": "Bearer k"}
    body = {**GREEDY, "input": "What is 2 + 2?", "max_output_tokens": 24, **THINK}
    asked = {**GREEDY, "messages": [{"role": "user", "content": "What is 2 + 2?"}],
             "max_tokens": 24, **THINK}  # fmt: skip
    chat = _post(thinking_server, asked, "/v1/chat/completions", headers=auth).json()
    message = chat["choices"][0]["message"]
    assert message["reasoning"] and message["content"]
    r = _post(thinking_server, body, headers=auth)
    whole = Response.model_validate(r.json())
    reasoning, answer = whole.output
    assert reasoning.type == "reasoning" and reasoning.summary == []
    assert reasoning.content[0].type == "reasoning_text"
    assert reasoning.content[0].text == message["reasoning"]
    assert answer.type == "message" and whole.output_text == message["content"]
    assert chat["choices"][0]["finish_reason"] == "stop" and whole.status == "completed"
    details = chat["usage"]["completion_tokens_details"]["reasoning_tokens"]
    assert whole.usage.output_tokens_details.reasoning_tokens == details == 7  # budget + tag
    # reasoning.effort is chat's reasoning_effort: "none" ends the block at once
    effortless = {k: v for k, v in body.items() if k != "thinking_token_budget"}
    none = _post(thinking_server, {**effortless, "reasoning": {"effort": "none"}}, headers=auth)
    none = Response.model_validate(none.json())
    assert [item.type for item in none.output] == ["message"]
    assert none.usage.output_tokens_details.reasoning_tokens == 1  # the end tag alone
    # streamed: the reasoning's deltas (item 0), then the answer's (item 1)
    events = []
    with httpx.stream("POST", thinking_server.base + "/v1/responses", headers=auth,
                      json={**body, "stream": True}, timeout=120) as s:  # fmt: skip
        for line in s.iter_lines():
            if line.startswith("data: "):
                events.append(EVENTS.validate_python(json.loads(line[6:])))
    kinds = [e.type for e in events]
    thought = [e for e in events if e.type == "response.reasoning_text.delta"]
    said = [e for e in events if e.type == "response.output_text.delta"]
    assert "".join(e.delta for e in thought) == message["reasoning"]
    assert "".join(e.delta for e in said) == message["content"]
    assert {e.output_index for e in thought} == {0} and {e.output_index for e in said} == {1}
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    assert events[-1].type == "response.completed"
    final = events[-1].response
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == message["reasoning"]
    # the API key guards the Responses routes as the others
    assert _post(thinking_server, body).status_code == 401
    assert httpx.get(thinking_server.base + f"/v1/responses/{whole.id}").status_code == 401
    got = httpx.get(thinking_server.base + f"/v1/responses/{whole.id}", headers=auth)
    assert got.json() == r.json()


ADD = {"type": "function", "name": "add", "parameters": {
    "type": "object", "properties": {"a": {"enum": [1, 2]}, "b": {"enum": [2, 3]}},
    "required": ["a", "b"], "additionalProperties": False}}  # fmt: skip
AUTH = {"authorization": "Bearer k"}


def test_a_thinking_model_gives_a_reasoning_item_then_a_function_call_whole_and_streamed(
    thinking_server,
):
    think = {k: v for k, v in THINK.items() if k != "structured_outputs"}
    body = {**GREEDY, "input": "What is 2 + 2?", "max_output_tokens": 48, "tools": [ADD],
            "tool_choice": "required", "parallel_tool_calls": False, **think}  # fmt: skip
    whole = Response.model_validate(_post(thinking_server, body, headers=AUTH).json())
    reasoning, call = whole.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text
    assert (call.type, call.name, whole.status) == ("function_call", "add", "completed")
    jsonschema.validate(json.loads(call.arguments), ADD["parameters"])
    assert whole.usage.output_tokens_details.reasoning_tokens == 7  # budget + tag
    chat_tool = {"type": "function", "function": {k: v for k, v in ADD.items() if k != "type"}}
    asked = {**GREEDY, "messages": [{"role": "user", "content": "What is 2 + 2?"}],
             "max_tokens": 48, "tools": [chat_tool], "tool_choice": "required",
             "parallel_tool_calls": False, **think}  # fmt: skip
    chat = _post(thinking_server, asked, "/v1/chat/completions", headers=AUTH).json()
    message = chat["choices"][0]["message"]
    assert reasoning.content[0].text == message["reasoning"]
    assert call.arguments == message["tool_calls"][0]["function"]["arguments"]

    events = []
    with httpx.stream("POST", thinking_server.base + "/v1/responses", headers=AUTH,
                      json={**body, "stream": True}, timeout=120) as s:  # fmt: skip
        for line in s.iter_lines():
            if line.startswith("data: "):
                events.append(EVENTS.validate_python(json.loads(line[6:])))
    kinds = [e.type for e in events]
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert thought == reasoning.content[0].text
    assert "response.output_text.delta" not in kinds
    args = [e for e in events if e.type == "response.function_call_arguments.delta"]
    assert [(e.output_index, e.delta) for e in args] == [(1, call.arguments)]
    assert kinds.index("response.reasoning_text.done") < kinds.index(
        "response.function_call_arguments.delta"
    )
    final = events[-1]
    assert final.type == "response.completed"
    assert [item.type for item in final.response.output] == ["reasoning", "function_call"]
    assert final.response.output[1].arguments == call.arguments


def test_a_schema_answer_follows_free_reasoning_in_a_response(thinking_server):
    fmt = {"type": "json_schema", "name": "pet", "schema": SCHEMA, "strict": True}
    think = {k: v for k, v in THINK.items() if k != "structured_outputs"}
    body = {**GREEDY, "input": "describe a pet", "max_output_tokens": 64,
            "text": {"format": fmt}, **think}  # fmt: skip
    got = Response.model_validate(_post(thinking_server, body, headers=AUTH).json())
    reasoning, answer = got.output
    assert reasoning.type == "reasoning" and answer.type == "message"
    assert got.status == "completed"
    jsonschema.validate(json.loads(got.output_text), SCHEMA)
    text = reasoning.content[0].text
    with pytest.raises(json.JSONDecodeError):  # the grammar held only after the reasoning
        json.loads(text)
    assert got.usage.output_tokens_details.reasoning_tokens == 7
    json_schema = {"name": "pet", "schema": SCHEMA, "strict": True}
    asked = {**GREEDY, "messages": [{"role": "user", "content": "describe a pet"}],
             "max_tokens": 64, "response_format": {"type": "json_schema",
             "json_schema": json_schema}, **think}  # fmt: skip
    chat = _post(thinking_server, asked, "/v1/chat/completions", headers=AUTH).json()
    message = chat["choices"][0]["message"]
    assert (text, got.output_text) == (message["reasoning"], message["content"])


def test_reasoning_effort_minimal_is_a_budget_of_128_tokens_in_a_response(thinking_server):
    """A bias against the end tag (id 1023, the Thinking toy's) keeps the random weights from
    ending the block themselves; effort 'minimal' (128 tokens) ends it, and 'low' (512)
    leaves the reasoning to max_output_tokens."""
    body = {**GREEDY, "input": "What is 2 + 2?", "max_output_tokens": 140,
            "logit_bias": {"1023": -100}, **{k: v for k, v in THINK.items()
            if k != "thinking_token_budget"}}  # fmt: skip
    minimal = {**body, "reasoning": {"effort": "minimal"}}
    got = Response.model_validate(_post(thinking_server, minimal, headers=AUTH).json())
    assert [item.type for item in got.output] == ["reasoning", "message"]
    assert got.usage.output_tokens_details.reasoning_tokens == 129  # 128 and the end tag
    assert re.fullmatch("[a-z]{2,6}", got.output_text) and got.reasoning.effort == "minimal"
    low = {**body, "reasoning": {"effort": "low"}}
    cut = Response.model_validate(_post(thinking_server, low, headers=AUTH).json())
    assert [item.type for item in cut.output] == ["reasoning"] and cut.status == "incomplete"
    assert cut.usage.output_tokens_details.reasoning_tokens == 140


# -- stored responses --------------------------------------------------------------------------


def test_stored_responses_are_read_continued_listed_and_deleted(server, client):
    first = client.responses.create(**GREEDY, input="Hello", instructions="Be terse.",
                                    max_output_tokens=4)  # fmt: skip
    got = client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text
    # continued: its input and output come first; its instructions do not (OpenAI's rule)
    second = client.responses.create(**GREEDY, previous_response_id=first.id, input="more",
                                      max_output_tokens=4)  # fmt: skip
    assert second.previous_response_id == first.id
    explicit = client.responses.create(
        **GREEDY, max_output_tokens=4,
        input=[*USER, {"role": "assistant", "content": first.output_text},
               {"role": "user", "content": "more"}],
    )  # fmt: skip
    assert second.output_text == explicit.output_text
    assert second.usage.input_tokens == explicit.usage.input_tokens
    chained = client.responses.create(**GREEDY, previous_response_id=second.id, input="again",
                                      max_output_tokens=2)  # fmt: skip
    assert chained.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens
    items = client.responses.input_items.list(second.id)
    assert [(i.type, i.role, i.content[0].text) for i in items.data] == [
        ("message", "user", "more")
    ]
    ResponseItemList.model_validate(
        httpx.get(server.base + f"/v1/responses/{explicit.id}/input_items?order=asc").json()
    )
    listed = httpx.get(server.base + f"/v1/responses/{explicit.id}/input_items",
                       params={"order": "asc", "limit": 2}).json()  # fmt: skip
    assert [i["role"] for i in listed["data"]] == ["user", "assistant"] and listed["has_more"]
    rest = httpx.get(server.base + f"/v1/responses/{explicit.id}/input_items",
                     params={"order": "asc", "after": listed["last_id"]}).json()  # fmt: skip
    assert [i["content"][0]["text"] for i in rest["data"]] == ["more"] and not rest["has_more"]
    # cancel: nothing runs in the background here
    r = _post(server, {}, f"/v1/responses/{first.id}/cancel")
    assert r.status_code == 400 and "background" in r.json()["error"]["message"]
    # deleted: gone
    r = httpx.delete(server.base + f"/v1/responses/{first.id}")
    assert r.json() == {"id": first.id, "object": "response.deleted", "deleted": True}
    for method, path in [("GET", ""), ("DELETE", ""), ("POST", "/cancel"), ("GET", "/input_items")]:
        r = httpx.request(method, server.base + f"/v1/responses/{first.id}{path}")
        assert r.status_code == 404 and first.id in r.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model="toy", previous_response_id=first.id, input="x")
    assert err.value.body["param"] == "previous_response_id"
    # store: false keeps nothing
    unstored = client.responses.create(**GREEDY, input="Hi", store=False, max_output_tokens=2)
    assert unstored.store is False
    assert httpx.get(server.base + f"/v1/responses/{unstored.id}").status_code == 404
    # a streamed response is stored when it ends
    with client.responses.stream(**GREEDY, input="Hi", max_output_tokens=2) as stream:
        events = list(stream)
    assert events[-1].type == "response.incomplete"
    stored = client.responses.retrieve(events[-1].response.id)
    assert stored.output_text == events[-1].response.output_text and stored.output_text
    assert stored.output[0].id == events[-1].response.output[0].id


def test_the_store_keeps_the_most_recently_used_up_to_its_capacity():
    store = ResponseStore(capacity=2)
    for name in ("a", "b"):
        store.put(Stored({"id": name}, [], []))
    store.get("a")  # used: "b" is now the least recently used
    store.put(Stored({"id": "c"}, [], []))
    assert store.get("a").response == {"id": "a"} and store.get("c").response == {"id": "c"}
    with pytest.raises(ApiError) as err:
        store.get("b", "previous_response_id")
    assert err.value.status == 404 and err.value.param == "previous_response_id"


# -- refusals ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body, param, message",
    [
        ({"max_tokens": 3}, "max_tokens", "did you mean 'max_output_tokens'?"),
        ({"background": True}, "background", "background responses are not supported"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type", "'web_search' are not available"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools[0].function",
         "is flat"),
        ({"tools": [{"type": "function", "name": "bad name!"}], "tool_choice": "none"},
         "tools[0].name", "tools[0].name"),
        ({"input": [USER[0], {"type": "web_search_call", "id": "x"}]}, "input[1].type",
         "items of type 'web_search_call' are not supported"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
         "input[0].content[0].type", "only text"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id",
         "Field required"),
        ({"input": [{"role": "user", "content": "x", "nope": 1}]}, "input[0].nope", "unknown"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role", "input[0].role"),
        ({"input": [1]}, "input[0]", "an item is an object"),
        ({"input": 1}, "input", "input"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]},
         "input[0].arguments", "not valid JSON"),
        ({"truncation": "auto"}, "truncation", "never cut"),
        ({"include": ["message.output_text.logprobs"]}, "include[0]", "not supported"),
        ({"conversation": "conv_1"}, "conversation", "previous_response_id"),
        ({"max_output_tokens": 100000}, "max_output_tokens", "exceeds"),
        ({"temperature": 3}, "temperature", "temperature"),
        ({"text": {"format": {"type": "json_schema", "name": "x",
                              "schema": {"type": "array", "uniqueItems": True}, "strict": True}}},
         "text.format.schema", "text.format.schema"),
        ({"text": {"format": {"type": "yaml"}}}, "text.format.type", "text.format.type"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
         "tool_choice.name", "not among the tools"),
        ({"tools": [WEATHER], "tool_choice": {"type": "file_search"}}, "tool_choice.type",
         "not supported"),
        ({"tools": [WEATHER]}, "tool_choice", "tool_choice 'auto' needs a chat template"),
        ({"input": []}, "input", "input: List should have at least 1 item"),
        ({"stream_options": {"include_obfuscation": False}}, "stream_options", "stream=true"),
        ({"previous_response_id": "resp_unknown"}, "previous_response_id", "resp_unknown"),
        ({"model": "gpt-5"}, "model", "does not exist"),
    ],
)  # fmt: skip
def test_requests_the_server_cannot_honour_are_refused_naming_the_field(
    server, body, param, message
):
    r = _post(server, {"model": "toy", "input": "x", "max_output_tokens": 2, **body})
    error = r.json()["error"]
    assert r.status_code in (400, 404), r.text
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and message in error["message"], error
    assert _post(server, {"model": "toy", "input": "x", "max_output_tokens": 2}).status_code == 200


ODD = [None, -1, "x", [], [1], {"a": 1}, True]


def test_odd_values_of_every_field_are_answered_without_a_server_error(server):
    good = {"model": "toy", "input": "x", "max_output_tokens": 1}
    item = {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}
    own = [name for name in ResponsesRequest.model_fields if name not in PASSED_ON]
    bodies = [{**good, name: value} for name in own for value in ODD]
    bodies += [{**good, "input": [value]} for value in ODD]
    bodies += [{**good, "input": [{**item, key: value}]} for key in item for value in ODD]
    bodies += [{**good, "input": [{"role": "user", "content": [value]}]} for value in ODD]
    bodies += [{**good, "tools": [{"type": "function", "name": "f", "parameters": value}]}
               for value in ODD]  # fmt: skip
    for body in bodies:
        r = _post(server, body)
        assert r.status_code < 500, (body, r.text)
        if r.status_code >= 400:
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text


def test_an_engine_error_mid_stream_is_a_failed_response():
    writer = ResponseEvents({"id": "resp_1", "object": "response", "created_at": 0,
                             "model": "toy", "output": [], "tools": [], "tool_choice": "auto",
                             "parallel_tool_calls": True, "status": "in_progress"})  # fmt: skip
    events = writer.start() + writer.delta({"delta": {"content": "ab"}, "finish_reason": None})
    events += writer.fail(ApiError(500, "generation failed: boom", "server_error"))
    for event in events:
        EVENTS.validate_python(event)
    failed = events[-1]["response"]
    assert events[-1]["type"] == "response.failed" and failed["status"] == "failed"
    # the message begun is ended where it was, before the failure
    assert [e["type"] for e in events[-4:-1]] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert failed["output"][0]["status"] == "incomplete"
    assert failed["output"][0]["content"][0]["text"] == "ab"
    assert failed["error"] == {"code": "server_error", "message": "generation failed: boom"}
