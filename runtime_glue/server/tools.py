"""Tool calls: OpenAI's ``tools`` and ``tool_choice`` turned into a plan for one chat request.

- ``none``: the tools reach the chat template (when it renders tools) and nothing is parsed;
- ``required`` and a named function are enforced by a JSON schema built from the tools'
  parameter schemas (``runtime_glue.engine.structured``), so the output is always a call: a
  named function's output is its arguments object (vLLM's way); ``required`` gives
  ``{"name": ..., "arguments": {...}}``, or a list of 1 to ``MAX_PARALLEL_CALLS`` of them
  when ``parallel_tool_calls`` is true (OpenAI's default): a bound, so that a model that keeps
  choosing another call still ends its list (a weak or random one did, until max_tokens);
- ``auto`` (OpenAI's default when tools are given) follows the checkpoint's chat template: a
  template that renders ``tools`` gets them, and the output's ``<tool_call>{...}</tool_call>``
  blocks (the Hermes convention such templates teach, as Qwen's) become calls. A template that
  does not render tools (the toy checkpoints', Ouro's own ChatML) cannot ask the model for a
  call: ``auto`` is then a 400 saying so, as vLLM's is without a tool parser.

The calls come back in OpenAI's shape (``call_...`` ids, ``function.arguments`` as JSON text) with
``finish_reason: "tool_calls"``; a stream holds the calls back and sends them as deltas at the end.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Annotated, Any, Literal

import attrs
import jinja2
from jinja2 import meta
from pydantic import BaseModel, ConfigDict, Field

from runtime_glue.engine.structured import StructuredSpec

MAX_PARALLEL_CALLS = 8  # calls a required output may hold with parallel_tool_calls


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ToolError(ValueError):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def renders_tools(template: Any) -> bool:
    """Whether a chat template uses the ``tools`` variable (transformers passes it there)."""
    if isinstance(template, dict):  # named templates: the one for tools
        template = template.get("tool_use") or template.get("default")
    if not isinstance(template, str):
        return False
    try:
        ast = jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError:
        return False
    return "tools" in meta.find_undeclared_variables(ast)


_ANY_OBJECT: dict = {"type": "object"}
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


def _call(name: str, arguments: str) -> dict:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def _compact(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


@attrs.frozen
class ToolPlan:
    """What a chat request's tools ask of the template, the decoding and the response."""

    mode: str  # none | auto | required | named
    tools: tuple[dict, ...]  # as the template receives them (OpenAI's shape)
    render: bool  # the template renders tools
    name: str | None = None  # named: the function
    parallel: bool = True

    @property
    def parses(self) -> bool:
        """Whether the output becomes tool calls (and a stream holds it back)."""
        return self.mode in ("required", "named") or (self.mode == "auto" and self.render)

    def template_kwargs(self) -> dict:
        return {"tools": list(self.tools)} if self.render and self.tools else {}

    def spec(self) -> StructuredSpec | None:
        """The schema that enforces ``required`` or a named call (compact JSON: the model's
        tokens go to the call, not to whitespace)."""
        if self.mode not in ("required", "named"):
            return None
        functions = {t["function"]["name"]: t["function"] for t in self.tools}
        if self.mode == "named":
            assert self.name is not None
            schema = functions[self.name].get("parameters") or _ANY_OBJECT
            strict = bool(functions[self.name].get("strict"))
        else:
            calls = [
                {
                    "type": "object",
                    "properties": {
                        "name": {"const": name},
                        "arguments": f.get("parameters") or _ANY_OBJECT,
                    },
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
                for name, f in functions.items()
            ]
            one = calls[0] if len(calls) == 1 else {"anyOf": calls}
            schema = (
                {"type": "array", "items": one, "minItems": 1, "maxItems": MAX_PARALLEL_CALLS}
                if self.parallel
                else one
            )
            strict = any(f.get("strict") for f in functions.values())
        return StructuredSpec("json", _compact(schema), strict=strict, whitespace="", param="tools")

    def calls(self, text: str) -> tuple[str | None, list[dict]]:
        """The output as (content, tool calls); no calls when it does not parse (cut short)."""
        if self.mode == "named":
            assert self.name is not None
            try:
                return None, [_call(self.name, _compact(json.loads(text)))]
            except json.JSONDecodeError:  # cut short by max_tokens: the arguments so far
                return None, [_call(self.name, text)]
        if self.mode == "required":
            try:
                value = json.loads(text)
            except json.JSONDecodeError:
                return text, []
            items = value if isinstance(value, list) else [value]
            return None, [_call(c["name"], _compact(c["arguments"])) for c in items]
        if self.mode == "auto" and self.render:
            return _hermes_calls(text)
        return text, []


def _hermes_calls(text: str) -> tuple[str | None, list[dict]]:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (the Hermes
    convention); a block that does not parse stays in the content."""
    calls, kept, pos = [], [], 0
    for m in re.finditer(re.escape(_OPEN) + r"\s*(.*?)\s*" + re.escape(_CLOSE), text, re.S):
        try:
            call = json.loads(m.group(1))
            name = call["name"]
            arguments = call.get("arguments", call.get("parameters", {}))
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
        kept.append(text[pos : m.start()])
        pos = m.end()
        calls.append(_call(str(name), _compact(arguments)))
    kept.append(text[pos:])
    content = "".join(kept)  # not stripped: it begins with what a stream sent of it
    return (content if content.strip() else None), calls


class AutoStream:
    """Streams an ``auto`` output's content up to a ``<tool_call>``; from there on the text is
    held back, to be parsed when the output ends."""

    def __init__(self) -> None:
        self.sent, self.held = "", False

    def feed(self, text: str) -> str:
        """The content of ``text`` (the whole output so far) that can be sent now."""
        if self.held:
            return ""
        at = text.find(_OPEN)
        if at >= 0:
            self.held = True
            safe = text[:at]
        else:  # hold back what may be the start of a tag
            keep = next((k for k in range(len(_OPEN) - 1, 0, -1) if text.endswith(_OPEN[:k])), 0)
            safe = text[: len(text) - keep]
        delta = safe[len(self.sent) :] if safe.startswith(self.sent) else ""
        self.sent += delta
        return delta


def plan_tools(
    tools: list[Tool] | None,
    choice: ToolChoice | None,
    parallel: bool | None,
    render: bool,
) -> ToolPlan | None:
    """The request's plan, or None without tools; ``render``: whether the chat template renders
    tools (``renders_tools``). Raises ``ToolError`` naming the field."""
    if not tools:
        if choice not in (None, "none"):
            raise ToolError("tool_choice", "tool_choice needs tools")
        return None
    names = [t.function.name for t in tools]
    if len(set(names)) < len(names):
        raise ToolError("tools", f"tool names must be unique, got {names}")
    as_dicts = tuple(t.model_dump(exclude_none=True) for t in tools)
    parallel = True if parallel is None else parallel
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise ToolError(
                "tool_choice.function.name",
                f"tool_choice names {choice.function.name!r}, which is not among the tools {names}",
            )
        return ToolPlan("named", as_dicts, render, choice.function.name, parallel)
    mode = choice or "auto"
    if mode == "auto" and not render:
        raise ToolError(
            "tool_choice",
            "tool_choice 'auto' needs a chat template that renders tools, and this model's "
            "does not: ask for tool_choice 'required' or a named function (enforced with the "
            "tools' schemas), or 'none'",
        )
    return ToolPlan(mode, as_dicts, render, None, parallel)
