"""OpenAI's Responses API, ``POST /v1/responses``, on the chat pipeline.

A request is translated into a chat completion request (``to_chat``, with the request's schema
in ``runtime_glue.server.response_input``) and runs as one (the
chat template, tools, structured outputs, the reasoning parser: all chat's); its one choice
comes back as Responses output items, whole (``response_object``) or as the Responses stream
events (``ResponseEvents``), translated from the chat stream's chunk payloads
(``routes.ChunkStream.payloads``). Errors name the Responses field (``input[2].type``,
``max_output_tokens``, ``text.format.schema``) where the chat pipeline names its own.

Stored responses (``store``, true by default as OpenAI's) live in an in-memory LRU of the
last ``MAX_STORED`` per server process: ``previous_response_id`` continues one (its input and
output come before the new input; its ``instructions`` do not, as OpenAI's), ``GET`` and
``DELETE /v1/responses/{id}`` read and remove one, ``/input_items`` lists its input. Nothing
survives a restart, and replicas do not share theirs.

Refused, by name: ``background: true`` (responses run while the request waits or streams,
so there is nothing to ``cancel`` either), tools other than functions (web search, file
search, MCP, ...), ``truncation: "auto"``, ``conversation``, and ``include`` values other
than ``reasoning.encrypted_content`` (accepted, without effect: reasoning comes back as
plain text).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Annotated, Literal

import attrs
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import Field

from runtime_glue.server.protocol import ApiError
from runtime_glue.server.response_input import (
    ReasoningConfig,
    ResponsesRequest,
    refuse,
    to_chat,
)
from runtime_glue.server.response_output import (
    ResponseEvents,
    assistant_message,
    response_object,
    sse,
)
from runtime_glue.server.routes import ChunkStream, merged_outputs, respond

MAX_STORED = 1000  # stored responses per server process (least recently used dropped)


# A chat request's fields that the Responses API names otherwise (an unknown field's hint).
def envelope(response_id: str, model: str, req: ResponsesRequest) -> dict:
    """The response before its output: what the request asked for, echoed."""
    fmt = req.text.format if req.text is not None and req.text.format else {"type": "text"}
    text: dict = {"format": fmt}
    if req.text is not None and req.text.verbosity is not None:
        text["verbosity"] = req.text.verbosity
    reasoning = req.reasoning or ReasoningConfig()
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": "in_progress",
        "background": False,
        "error": None,
        "incomplete_details": None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "model": model,
        "output": [],
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": reasoning.effort, "summary": reasoning.summary},
        "store": req.store,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "text": text,
        "tool_choice": req.tool_choice or "auto",
        "tools": req.tools or [],
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "truncation": "disabled",
        "usage": None,
        "user": req.user,
        "metadata": req.metadata or {},
    }


# -- the store and the routes --------------------------------------------------------------


@attrs.frozen
class Stored:
    response: dict
    conversation: list[dict]  # its history, input and output, as chat messages
    items: list[dict]  # its own input items


class ResponseStore:
    """The last ``capacity`` stored responses (an LRU; the event loop is its only user)."""

    def __init__(self, capacity: int = MAX_STORED) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, Stored] = OrderedDict()

    def put(self, stored: Stored) -> None:
        self._items[stored.response["id"]] = stored
        self._items.move_to_end(stored.response["id"])
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str, param: str | None = None) -> Stored:
        """The stored response, or a 404 (naming ``param``)."""
        stored = self._items.get(response_id)
        if stored is None:
            refuse(
                param,
                f"no stored response {response_id!r} (responses are kept in memory, the last "
                f"{self.capacity}, when created with store: true)",
                404,
            )
        self._items.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        del self._items[response_id]


def install_responses_routes(app: FastAPI, server, handle) -> None:
    """``POST /v1/responses`` and the stored responses' routes; ``handle``: the app's chat
    request runner, given the answer that makes its choice a response."""
    store = ResponseStore()

    @app.post("/v1/responses")
    async def create(body: ResponsesRequest, request: Request):
        server.check_auth(request)
        server.check_model(body.model)
        body.check_supported()
        history: list[dict] = []
        if body.previous_response_id is not None:
            history = store.get(body.previous_response_id, "previous_response_id").conversation
        plan = to_chat(body, history)

        def keep(response: dict) -> None:
            if body.store and response["status"] in ("completed", "incomplete"):
                conversation = [*plan.conversation, assistant_message(response["output"])]
                store.put(Stored(response, conversation, plan.items))

        async def answer(server, chat, choices, request, rid, render, shown):
            head = envelope("resp_" + rid.split("-", 1)[1], server.model_name, body)
            if not body.stream:
                completion = await respond(server, chat, choices, request, rid, render, shown)
                response = response_object(head, completion)
                keep(response)
                return response
            stream = ChunkStream(render, {}, choices, chat)
            outputs = stream.payloads(merged_outputs(server, choices, rid, request))
            return StreamingResponse(
                _events(ResponseEvents(head), stream, outputs, keep),
                media_type="text/event-stream",
            )

        try:
            return await handle(plan.chat, request, "resp", answer)
        except ApiError as exc:
            raise plan.origins.error(exc) from None

    @app.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str, request: Request):
        server.check_auth(request)
        return store.get(response_id).response

    @app.delete("/v1/responses/{response_id}")
    async def delete(response_id: str, request: Request):
        server.check_auth(request)
        store.delete(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel(response_id: str, request: Request):
        server.check_auth(request)
        store.get(response_id)
        refuse(
            None,
            "only background responses can be cancelled, and this server runs none "
            f"({response_id!r} has finished)",
        )

    @app.get("/v1/responses/{response_id}/input_items")
    async def input_items(
        response_id: str,
        request: Request,
        after: str | None = None,
        limit: Annotated[int, Field(ge=1, le=100)] = 20,
        order: Literal["asc", "desc"] = "desc",
    ):
        server.check_auth(request)
        items = store.get(response_id).items
        items = items[::-1] if order == "desc" else list(items)
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                refuse("after", f"no input item {after!r} in response {response_id!r}")
            items = items[ids.index(after) + 1 :]
        page = items[:limit]
        return {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > limit,
        }


async def _events(writer: ResponseEvents, stream: ChunkStream, outputs, keep):
    """The SSE of a streamed response; it is stored (``keep``) when it has finished."""
    for event in writer.start():
        yield sse(event)
    reason = None
    try:
        async for _choice, payload, _tokens in outputs:
            reason = payload.get("finish_reason") or reason
            for event in writer.delta(payload):
                yield sse(event)
    except ApiError as exc:
        for event in writer.fail(exc):
            yield sse(event)
        return
    if reason is None:  # the client has gone; nobody reads on
        return
    *events, last = writer.finish(reason, stream.usage())
    for event in events:
        yield sse(event)
    keep(last["response"])
    yield sse(last)
