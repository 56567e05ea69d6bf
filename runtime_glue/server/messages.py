"""Chat messages in OpenAI's shapes, and what the chat template receives of them.

Content is a string or a list of text parts (joined with newlines, as vLLM joins them);
``developer`` is the system role under its newer name; an assistant message may carry
``tool_calls`` (its ``content`` then may be null) and a ``tool`` message answers one by its
``tool_call_id``. The template gets what the Hugging Face chat-template convention expects:
``content`` a string, tool-call ``arguments`` a dict. Anything else is refused, naming the
field (``messages[2].content[1].type``).
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict


class MessageError(ValueError):
    """A message the server cannot render; ``param`` names the field at fault."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


class ContentPart(BaseModel):
    # Open, so that an unsupported part's own fields do not hide what is wrong with it: its
    # type (checked in ``text_of``).
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    arguments: str  # JSON, as OpenAI sends it


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant messages only
    tool_call_id: str | None = None  # tool messages only

    def for_template(self, where: str) -> dict:
        """The message as the chat template sees it; ``where``: ``messages[i]``."""
        self._check_role_fields(where)
        out: dict = {
            "role": "system" if self.role == "developer" else self.role,
            "content": text_of(self.content, f"{where}.content"),
        }
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls is not None:
            out["tool_calls"] = [
                _template_call(call, f"{where}.tool_calls[{j}]")
                for j, call in enumerate(self.tool_calls)
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out

    def _check_role_fields(self, where: str) -> None:
        if self.content is None and self.role != "assistant":
            raise MessageError(f"{where}.content", f"a {self.role} message needs content")
        if self.tool_calls is not None and self.role != "assistant":
            raise MessageError(f"{where}.tool_calls", "only assistant messages carry tool_calls")
        if self.role == "tool" and self.tool_call_id is None:
            raise MessageError(
                f"{where}.tool_call_id", "a tool message needs the tool_call_id it answers"
            )
        if self.role != "tool" and self.tool_call_id is not None:
            raise MessageError(f"{where}.tool_call_id", "only tool messages carry tool_call_id")


def text_of(content: str | list[ContentPart] | None, where: str) -> str:
    """A message's content as one string: text parts joined by newlines (vLLM's rule), or
    "" for an assistant message with none."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for i, part in enumerate(content):
        if part.type != "text":
            raise MessageError(
                f"{where}[{i}].type",
                f"content parts of type {part.type!r} are not supported; only 'text'",
            )
        if part.text is None:
            raise MessageError(f"{where}[{i}].text", "a text part needs its text")
        extra = sorted(part.model_extra or {})
        if extra:
            raise MessageError(
                f"{where}[{i}].{extra[0]}", f"unknown field {extra[0]!r} is not supported"
            )
        texts.append(part.text)
    return "\n".join(texts)


def _template_call(call: ToolCall, where: str) -> dict:
    # Chat templates (the HF convention) take a call's arguments as a dict; OpenAI sends JSON.
    raw = call.function.arguments
    try:
        arguments = json.loads(raw) if raw.strip() else {}
    except json.JSONDecodeError as exc:
        raise MessageError(
            f"{where}.function.arguments", f"the arguments are not valid JSON ({exc})"
        ) from None
    return {
        "id": call.id,
        "type": call.type,
        "function": {"name": call.function.name, "arguments": arguments},
    }


def template_messages(messages: list[ChatMessage]) -> list[dict]:
    """Every message as the chat template sees it; raises ``MessageError`` naming the field."""
    return [m.for_template(f"messages[{i}]") for i, m in enumerate(messages)]
