"""The output side of ``POST /v1/responses`` (``runtime_glue.server.responses``): output items,
the Responses stream events written from the chat stream's chunk payloads (``ResponseEvents``),
the whole response written by the same writer (``response_object``), and a response's output
as the chat message that continues its conversation."""

from __future__ import annotations

import json
import time
import uuid

from runtime_glue.server.protocol import ApiError


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# -- items ---------------------------------------------------------------------------


def message_item(item_id: str, role: str, content, status: str = "completed") -> dict:
    """A message item: an input message's (input_text parts) or the model's (output_text)."""
    texts = [content] if isinstance(content, str) else [p.text for p in content]
    parts: list[dict]
    if role == "assistant":
        parts = [
            {"type": "output_text", "text": t, "annotations": [], "logprobs": []} for t in texts
        ]
    else:
        parts = [{"type": "input_text", "text": t} for t in texts]
    return {"id": item_id, "type": "message", "role": role, "status": status, "content": parts}


def _reasoning_item(item_id: str, text: str, status: str) -> dict:
    return {"id": item_id, "type": "reasoning", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}  # fmt: skip


def call_item(item_id: str, call: dict, status: str) -> dict:
    function = call["function"]
    return {"id": item_id, "type": "function_call", "call_id": call["id"], "status": status,
            "name": function["name"], "arguments": function["arguments"]}  # fmt: skip


def usage(chat_usage: dict) -> dict:
    """Chat's usage as the Responses'. Cached tokens are not counted (0)."""
    details = chat_usage.get("completion_tokens_details") or {}
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": details.get("reasoning_tokens", 0)},
        "total_tokens": chat_usage["total_tokens"],
    }


# A chat finish reason's Responses status: what else ends a request (an abort: the client went
# away) is cancelled, and not stored.
STATUS = {"stop": "completed", "tool_calls": "completed", "length": "incomplete"}


def finished(head: dict, output: list[dict], finish_reason: str | None, chat_usage) -> dict:
    """The whole response: ``length`` (max_output_tokens) is ``incomplete``."""
    status = STATUS.get(finish_reason or "", "cancelled")
    return {
        **head,
        "status": status,
        "completed_at": int(time.time()),
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "output": output,
        "usage": usage(chat_usage) if chat_usage is not None else None,
    }


def response_object(head: dict, completion: dict) -> dict:
    """A whole chat completion (one choice) as the response: its message as one chunk through
    the stream's writer, so that whole and streamed responses have the same items."""
    choice = completion["choices"][0]
    writer = ResponseEvents(head)
    writer.delta({"delta": choice["message"], "finish_reason": choice["finish_reason"]})
    return writer.finish(choice["finish_reason"], completion["usage"])[-1]["response"]


class ResponseEvents:
    """The Responses stream events of one chat stream's chunk payloads, numbered: an item is
    added when its first text comes (reasoning, then the message) and done when the next
    begins or the response ends; tool calls come whole, at the end, as chat's do."""

    def __init__(self, head: dict) -> None:
        self.head, self.seq = head, 0
        self.output: list[dict] = []
        self.open: dict | None = None  # the item being written: reasoning or message

    def event(self, kind: str, **fields) -> dict:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def start(self) -> list[dict]:
        return [
            self.event("response.created", response=self.head),
            self.event("response.in_progress", response=self.head),
        ]

    def delta(self, payload: dict) -> list[dict]:
        """The events of one chunk payload (chat's ``delta``)."""
        delta, events = payload["delta"], []
        if delta.get("reasoning"):
            events += self._write("reasoning", delta["reasoning"])
        if delta.get("content"):
            events += self._write("message", delta["content"])
        calls = delta.get("tool_calls") or []
        if calls:
            events += self._close("completed")
        for k, call in enumerate(calls):
            cut = payload.get("finish_reason") == "length" and k == len(calls) - 1
            events += self._call(call, "incomplete" if cut else "completed")
        return events

    def finish(self, finish_reason: str | None, chat_usage) -> list[dict]:
        """The open item done, and the whole response (``response.completed`` or
        ``response.incomplete``)."""
        status = STATUS.get(finish_reason or "", "cancelled")
        item_status = "completed" if status == "completed" else "incomplete"
        events = self._close(item_status)
        if not self.output:  # nothing written: an empty message
            events += self._open("message") + self._close(item_status)
        response = finished(self.head, self.output, finish_reason, chat_usage)
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}
        return [*events, self.event(kind.get(status, "response.failed"), response=response)]

    def fail(self, exc: ApiError) -> list[dict]:
        """The open item ended where it was, and the response failed."""
        events = self._close("incomplete")
        error = {"code": "server_error", "message": str(exc)}
        response = {**self.head, "status": "failed", "error": error, "output": self.output}
        return [*events, self.event("response.failed", response=response)]

    def _write(self, kind: str, text: str) -> list[dict]:
        events = []
        if self.open is None or self.open["type"] != kind:
            events = self._close("completed") + self._open(kind)
        item = self.open
        assert item is not None
        item["text"] += text
        name = (
            "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        )
        extra: dict = {"logprobs": []} if kind == "message" else {}
        events.append(self.event(name, **self._where(), content_index=0, delta=text, **extra))
        return events

    def _where(self) -> dict:
        assert self.open is not None
        return {"item_id": self.open["id"], "output_index": len(self.output)}

    def _part(self, kind: str, text: str) -> dict:
        if kind == "reasoning":
            return {"type": "reasoning_text", "text": text}
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def _item(self, kind: str, item_id: str, text: str, status: str) -> dict:
        if kind == "reasoning":
            return _reasoning_item(item_id, text, status)
        return message_item(item_id, "assistant", text, status)

    def _open(self, kind: str) -> list[dict]:
        item_id = new_id("rs" if kind == "reasoning" else "msg")
        self.open = {"type": kind, "id": item_id, "text": ""}
        added = {**self._item(kind, item_id, "", "in_progress"), "content": []}
        return [
            self.event("response.output_item.added", output_index=len(self.output), item=added),
            self.event(
                "response.content_part.added",
                **self._where(),
                content_index=0,
                part=self._part(kind, ""),
            ),  # fmt: skip
        ]

    def _close(self, status: str) -> list[dict]:
        if self.open is None:
            return []
        kind, text, where = self.open["type"], self.open["text"], self._where()
        if kind == "reasoning":
            done = self.event("response.reasoning_text.done", **where, content_index=0, text=text)
        else:
            done = self.event("response.output_text.done", **where, content_index=0, text=text,
                              logprobs=[])  # fmt: skip
        item = self._item(kind, self.open["id"], text, status)
        events = [
            done,
            self.event(
                "response.content_part.done", **where, content_index=0, part=self._part(kind, text)
            ),  # fmt: skip
            self.event("response.output_item.done", output_index=len(self.output), item=item),
        ]
        self.output.append(item)
        self.open = None
        return events

    def _call(self, call: dict, status: str) -> list[dict]:
        item = call_item(new_id("fc"), call, status)
        index, arguments = len(self.output), item["arguments"]
        where = {"item_id": item["id"], "output_index": index}
        self.output.append(item)
        return [
            self.event(
                "response.output_item.added",
                output_index=index,
                item={**item, "arguments": "", "status": "in_progress"},
            ),  # fmt: skip
            self.event("response.function_call_arguments.delta", **where, delta=arguments),
            self.event("response.function_call_arguments.done", **where, arguments=arguments),
            self.event("response.output_item.done", output_index=index, item=item),
        ]


def sse(event: dict) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"


def assistant_message(output: list[dict]) -> dict:
    """A response's output as the chat message that continues its conversation (its
    reasoning left out, as chat templates leave earlier turns' out)."""
    texts = [p["text"] for item in output if item["type"] == "message" for p in item["content"]]
    calls = [
        {"id": item["call_id"], "type": "function",
         "function": {"name": item["name"], "arguments": item["arguments"]}}
        for item in output if item["type"] == "function_call"
    ]  # fmt: skip
    message: dict = {"role": "assistant", "content": "".join(texts) if texts or not calls else None}
    if calls:
        message["tool_calls"] = calls
    return message
