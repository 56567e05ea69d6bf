"""The request side of OpenAI's Responses API (``runtime_glue.server.responses``): the request
schema, its input items, and ``to_chat``, which translates a request (after the stored
conversation it continues) into the chat completion request it runs as. Errors name the
Responses field (``input[2].type``, ``max_output_tokens``, ``text.format.schema``). The
output side: ``runtime_glue.server.response_output``."""

from __future__ import annotations

from typing import Annotated, Any, Literal, NoReturn

import attrs
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from runtime_glue.server.protocol import ApiError, ChatCompletionRequest, param_name
from runtime_glue.server.response_output import (
    call_item,
    message_item,
    new_id,
)

CHAT_NAMES = {
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "messages": "input",
    "response_format": "text.format",
    "reasoning_effort": "reasoning.effort",
}
# include values accepted without effect (the reasoning is returned as plain text).
INCLUDABLE = ("reasoning.encrypted_content",)


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: dict[str, Any] | None = None  # text | json_object | json_schema: chat's response_format
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted, without effect


class ReasoningConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    effort: str | None = None  # the chat request's reasoning_effort: a thinking budget
    summary: str | None = None  # accepted; no summaries are written (summary: [])
    generate_summary: str | None = None  # OpenAI's older name of summary


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_obfuscation: bool | None = None  # nothing is obfuscated here


class PassedOn(BaseModel):
    """Fields a chat request takes that mean the same here (vLLM's and rlt-hal's extras):
    passed on as they are, checked (ranges included) by the chat request, whose errors name
    them alike. Their types here, their ranges the chat request's."""

    model_config = ConfigDict(extra="forbid")

    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    structured_outputs: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    cache_salt: str | None = None
    exit_at_step: int | None = None
    exit_threshold: float | None = None
    weighted_exit: bool | None = None
    num_speculative_tokens: int | None = None
    priority: int | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    thinking_token_budget: int | None = None


PASSED_ON = tuple(PassedOn.model_fields)


class ResponsesRequest(PassedOn):
    """OpenAI's Responses request, with the chat request's extras that mean the same here."""

    model_config = ConfigDict(extra="forbid")

    model: str
    # A string (one user message) or a list of items (``to_chat`` checks each, naming it).
    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: float | None = None  # None: the chat request's default (1.0); its ranges
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    background: bool | None = None
    include: list[str] | None = None
    # "disabled" only: an input longer than the context is a 400, never cut ("auto" would drop
    # the conversation's first items; refused by name rather than accepted as "disabled").
    truncation: Literal["auto", "disabled"] | None = None
    conversation: Any = None  # refused when set: continue with previous_response_id

    def check_supported(self) -> None:
        """What this server cannot do, refused by name (``ApiError``)."""
        if self.background:
            refuse(
                "background",
                "background responses are not supported: a response runs while its request "
                "waits or streams (send background: false or leave it out)",
            )
        if self.truncation == "auto":
            refuse(
                "truncation",
                "truncation 'auto' is not supported: an input longer than the context is a "
                "400, never cut (send 'disabled' or leave it out)",
            )
        if self.conversation is not None:
            refuse(
                "conversation",
                "conversations are not supported: continue a stored response with "
                "previous_response_id",
            )
        if self.stream_options is not None and not self.stream:
            refuse("stream_options", "stream_options requires stream=true")
        for i, name in enumerate(self.include or ()):
            if name not in INCLUDABLE:
                refuse(
                    f"include[{i}]",
                    f"include {name!r} is not supported; only {', '.join(INCLUDABLE)} "
                    "(without effect: the reasoning is returned as text)",
                )


def refuse(param: str | None, message: str, status: int = 400) -> NoReturn:
    raise ApiError(status, message, param=param)


# -- the request, as a chat request --------------------------------------------------------


class _Part(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None  # an output_text's, sent back: ignored
    logprobs: list[Any] | None = None


class _Item(BaseModel):
    """What every input item may carry besides its own fields (an output item sent back)."""

    model_config = ConfigDict(extra="forbid")
    id: str | None = None
    status: str | None = None


class _Message(_Item):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[_Part]
    phase: str | None = None


class _FunctionCall(_Item):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class _FunctionCallOutput(_Item):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[_Part]


_TEXT_PARTS = ("input_text", "output_text")
_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
_FUNCTION_TOOL_FIELDS = ("name", "description", "parameters", "strict")


def _parse(model: type[BaseModel], raw: dict, where: str):
    """``raw`` as ``model``; a 400 naming the field (``input[2].call_id``) otherwise."""
    for key in ("content", "output"):  # a part that is not text: refused by its type
        parts = raw.get(key)
        for j, part in enumerate(parts if isinstance(parts, list) else ()):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind is not None and kind not in _TEXT_PARTS:
                param = f"{where}.{key}[{j}].type"
                refuse(param, f"{param}: parts of type {kind!r} are not supported; only text")
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = f"{where}.{param_name(err['loc'])}".rstrip(".")
        if err["type"] == "extra_forbidden":
            refuse(param, f"unknown field {param!r} is not supported")
        refuse(param, f"{param}: {err['msg']}")


def _parts(content: str | list[_Part]) -> str | list[dict]:
    """A content's text parts as chat's (which joins them with newlines)."""
    if isinstance(content, str):
        return content
    return [{"type": "text", "text": p.text} for p in content]


def _text(content: str | list[_Part]) -> str:
    return content if isinstance(content, str) else "\n".join(p.text for p in content)


class Origins:
    """Where each chat field came from: a chat error's ``param`` (``messages[3].content``)
    as the Responses field (``input[2].content``). ``add(chat, name, keep)``: the chat field
    ``chat`` and what is under it are ``name`` (and what is under it, if ``keep``)."""

    def __init__(self) -> None:
        self.names: dict[str, tuple[str, bool]] = {
            "messages": ("input", False),
            "prompt": ("input", False),
            "max_tokens": ("max_output_tokens", True),
            "response_format.json_schema": ("text.format", True),
            "response_format": ("text.format", True),
            "tool_choice.function": ("tool_choice", True),
            "reasoning_effort": ("reasoning.effort", True),
        }

    def add(self, chat: str, name: str, keep: bool = True) -> None:
        self.names[chat] = (name, keep)

    def name(self, param: str | None) -> str | None:
        if param is None:
            return None
        for key in sorted(self.names, key=len, reverse=True):
            if param == key or param.startswith((key + ".", key + "[")):
                name, keep = self.names[key]
                return name + param[len(key) :] if keep else name
        return param

    def error(self, exc: ApiError) -> ApiError:
        """``exc`` naming the Responses field."""
        param = self.name(exc.param)
        message = str(exc)
        if (
            exc.param
            and param is not None
            and param != exc.param
            and message.startswith((exc.param + ":", exc.param + " "))
        ):
            message = param + message[len(exc.param) :]
        return ApiError(exc.status, message, exc.type, param, exc.code)


@attrs.frozen
class Translation:
    """A Responses request as a chat request."""

    chat: ChatCompletionRequest
    conversation: list[dict]  # the stored history and this input, as chat messages
    items: list[dict]  # this request's input items, with ids (``/input_items``)
    origins: Origins


class _Conversation:
    """Chat messages built from input items, each remembered as its item."""

    def __init__(self, origins: Origins) -> None:
        self.messages: list[dict] = []
        self.origins = origins
        self.items: list[dict] = []
        self._calls_to: int | None = None  # the assistant message a function_call joins

    def add(self, message: dict, name: str, keep: bool = True) -> int:
        k = len(self.messages)
        self.messages.append(message)
        self.origins.add(f"messages[{k}]", name, keep)
        self._calls_to = None
        return k

    def item(self, i: int, raw: Any) -> None:
        where = f"input[{i}]"
        if not isinstance(raw, dict):
            refuse(where, f"{where}: an item is an object (a message, a function_call, ...)")
        kind = raw.get("type", "message" if "role" in raw else None)
        if kind == "message":
            msg = _parse(_Message, raw, where)
            k = self.add({"role": msg.role, "content": _parts(msg.content)}, where)
            self._calls_to = k if msg.role == "assistant" else None
            self.items.append(message_item(msg.id or new_id("msg"), msg.role, msg.content))
        elif kind == "function_call":
            call = _parse(_FunctionCall, raw, where)
            tool_call = {"id": call.call_id, "type": "function",
                         "function": {"name": call.name, "arguments": call.arguments}}  # fmt: skip
            to = self._calls_to
            if to is None:  # calls after an assistant message join it, as chat has them
                to = self.add({"role": "assistant", "content": None, "tool_calls": []}, where)
            calls = self.messages[to].setdefault("tool_calls", [])
            chat = f"messages[{to}].tool_calls[{len(calls)}]"
            calls.append(tool_call)
            self.origins.add(chat, where, False)
            self.origins.add(chat + ".function", where)
            self._calls_to = to
            self.items.append(call_item(call.id or new_id("fc"), tool_call, "completed"))
        elif kind == "function_call_output":
            out = _parse(_FunctionCallOutput, raw, where)
            k = self.add(
                {"role": "tool", "tool_call_id": out.call_id, "content": _parts(out.output)}, where
            )
            self.origins.add(f"messages[{k}].content", f"{where}.output")
            self.origins.add(f"messages[{k}].tool_call_id", f"{where}.call_id")
            output = out.output if isinstance(out.output, str) else _text(out.output)
            item = {"id": out.id or new_id("fco"), "type": "function_call_output",
                    "call_id": out.call_id, "output": output, "status": "completed"}  # fmt: skip
            self.items.append(item)
        elif kind == "reasoning":  # the model's own earlier reasoning: not in the prompt
            if not isinstance(raw.get("id"), str):
                refuse(f"{where}.id", f"{where}.id: a reasoning item needs its id")
            self.items.append(raw)
        else:
            refuse(
                f"{where}.type",
                f"{where}.type: items of type {kind!r} are not supported here; only "
                f"{', '.join(_ITEM_TYPES)} (a message may leave its type out)",
            )


def _tools(tools: list[dict[str, Any]] | None) -> list[dict] | None:
    """Responses' flat function tools as chat's ``{type, function: {...}}``."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        kind = tool.get("type")
        if kind != "function":
            refuse(
                f"{where}.type",
                f"{where}.type: tools of type {kind!r} are not available here; only 'function' "
                "tools (which the client runs)",
            )
        if "function" in tool:
            refuse(
                f"{where}.function",
                f"{where}: a Responses function tool is flat ({{type: 'function', name, "
                "description, parameters, strict}), not chat's {type, function: {...}}",
            )
        extra = sorted(set(tool) - {"type", *_FUNCTION_TOOL_FIELDS})
        if extra:
            refuse(f"{where}.{extra[0]}", f"unknown field '{where}.{extra[0]}' is not supported")
        function = {k: tool[k] for k in _FUNCTION_TOOL_FIELDS if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: str | dict[str, Any] | None) -> str | dict | None:
    if not isinstance(choice, dict):
        return choice  # none | auto | required: checked by the chat request
    kind = choice.get("type")
    if kind != "function":
        refuse(
            "tool_choice.type",
            f"tool_choice.type: {kind!r} is not supported; only 'none', 'auto', 'required' or "
            "{type: 'function', name}",
        )
    extra = sorted(set(choice) - {"type", "name"})
    if extra:
        refuse(
            f"tool_choice.{extra[0]}", f"unknown field 'tool_choice.{extra[0]}' is not supported"
        )
    if not isinstance(choice.get("name"), str):
        refuse("tool_choice.name", "tool_choice.name: the function's name is required")
    return {"type": "function", "function": {"name": choice["name"]}}


def _response_format(text: TextConfig | None) -> dict | None:
    """``text.format`` as chat's ``response_format`` (which checks it)."""
    fmt = text.format if text is not None else None
    if fmt is None:
        return None
    kind = fmt.get("type")
    fields = ("name", "schema", "description", "strict") if kind == "json_schema" else ()
    extra = sorted(set(fmt) - {"type", *fields})
    if extra:
        refuse(
            f"text.format.{extra[0]}", f"unknown field 'text.format.{extra[0]}' is not supported"
        )
    if kind != "json_schema":
        return {"type": kind}
    return {"type": kind, "json_schema": {k: fmt[k] for k in fields if k in fmt}}


def to_chat(req: ResponsesRequest, history: list[dict]) -> Translation:
    """The chat request of ``req`` after ``history`` (a stored conversation's messages):
    ``instructions`` as a system message, then the history, then the input. Raises
    ``ApiError`` naming the Responses field."""
    origins = Origins()
    conv = _Conversation(origins)
    if req.instructions is not None:
        conv.add({"role": "system", "content": req.instructions}, "instructions", False)
    for message in history:
        conv.add(message, "previous_response_id", False)
    if isinstance(req.input, str):
        conv.add({"role": "user", "content": req.input}, "input", False)
        conv.items.append(message_item(new_id("msg"), "user", req.input))
    else:
        for i, raw in enumerate(req.input):
            conv.item(i, raw)
    for i in range(len(req.tools or ())):
        origins.add(f"tools[{i}].function", f"tools[{i}]")
    effort = req.reasoning.effort if req.reasoning is not None else None
    fields = {
        "max_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "tools": _tools(req.tools),
        "tool_choice": _tool_choice(req.tool_choice),
        "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": _response_format(req.text),
        "reasoning_effort": effort,
        "metadata": req.metadata,
        "user": req.user,
        **{name: getattr(req, name) for name in PASSED_ON},
    }
    body = {"model": req.model, "messages": conv.messages, "stream": req.stream}
    body.update({k: v for k, v in fields.items() if v is not None})
    try:
        chat = ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = param_name(err["loc"])
        raise origins.error(ApiError(400, f"{param}: {err['msg']}", param=param)) from None
    # the conversation to store: without instructions (OpenAI's: they are not carried over)
    conversation = conv.messages[1:] if req.instructions is not None else conv.messages
    return Translation(chat, conversation, conv.items, origins)


# -- the response's head -----------------------------------------------------------------
