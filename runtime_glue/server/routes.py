"""Turning engine outputs into OpenAI responses: whole, or streamed as server-sent events."""

from __future__ import annotations

import json
import time

from fastapi.responses import StreamingResponse

from runtime_glue.engine.request import RequestOutput
from runtime_glue.server.protocol import ApiError, error_body


def _usage(out: RequestOutput) -> dict:
    n = len(out.token_ids)
    return {
        "prompt_tokens": out.num_prompt_tokens,
        "completion_tokens": n,
        "total_tokens": out.num_prompt_tokens + n,
    }


def _stable_text(text: str, finished: bool) -> str:
    """Hold back a trailing replacement char: the next token may complete the character."""
    return text if finished or not text.endswith("\ufffd") else text.rstrip("\ufffd")


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


class _Shape:
    """What differs between /v1/completions and /v1/chat/completions."""

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        self.object = "chat.completion" if chat else "text_completion"
        self.chunk_object = "chat.completion.chunk" if chat else "text_completion"

    def choice(self, text: str, finish_reason: str | None) -> dict:
        if self.chat:
            return {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": finish_reason,
            }
        return {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}

    def delta(self, text: str | None, finish_reason: str | None, first: bool = False) -> dict:
        if self.chat:
            delta: dict = {}
            if first:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            return {"index": 0, "delta": delta, "finish_reason": finish_reason}
        return {"index": 0, "text": text or "", "finish_reason": finish_reason, "logprobs": None}


async def _respond(server, body, ids, params, request, rid: str, shape: _Shape):
    created = int(time.time())
    head = {"id": rid, "created": created, "model": server.model_name}
    outputs = server.outputs(rid, ids, params, request)
    if not body.stream:
        last: RequestOutput | None = None
        async for out in outputs:
            last = out
        if last is None:  # the client went away; nobody reads this
            raise ApiError(499, "client disconnected")
        if last.finish_reason == "error":
            raise ApiError(500, f"generation failed: {last.error}", "server_error")
        choice = shape.choice(last.text, last.finish_reason)
        if body.return_exit_steps:
            choice["exit_steps"] = list(last.exit_steps)
        return {**head, "object": shape.object, "choices": [choice], "usage": _usage(last)}
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    stream = _stream(outputs, head, shape, include_usage, body.return_exit_steps)
    return StreamingResponse(stream, media_type="text/event-stream")


async def _stream(outputs, head: dict, shape: _Shape, include_usage: bool, exit_steps: bool):
    chunk = {**head, "object": shape.chunk_object}
    sent, last, steps_sent = "", None, 0
    if shape.chat:
        yield _sse({**chunk, "choices": [shape.delta("", None, first=True)]})
    try:
        async for out in outputs:
            last = out
            if out.finish_reason == "error":
                yield _sse(error_body(f"generation failed: {out.error}", "server_error"))
                break
            text = _stable_text(out.text, out.finished)
            delta = text[len(sent) :] if text.startswith(sent) else ""
            sent = text if text.startswith(sent) else sent
            if delta or out.finished:
                reason = out.finish_reason if out.finished else None
                choice = shape.delta(delta, reason)
                if exit_steps:  # the tokens' loops since the last chunk
                    choice["exit_steps"] = list(out.exit_steps[steps_sent:])
                    steps_sent = len(out.exit_steps)
                yield _sse({**chunk, "choices": [choice]})
    except ApiError as exc:
        yield _sse(exc.body())
    if include_usage and last is not None:
        yield _sse({**chunk, "choices": [], "usage": _usage(last)})
    yield "data: [DONE]\n\n"


async def completion_response(server, body, ids, params, request, rid):
    return await _respond(server, body, ids, params, request, rid, _Shape(chat=False))


async def chat_response(server, body, ids, params, request, rid):
    return await _respond(server, body, ids, params, request, rid, _Shape(chat=True))
